"""python -m lab.device_check --out DIR [--tiny] [--budget-s 480] [--sections ...]"""
from __future__ import annotations

import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from trtspec.export.packs import write_atomic

SECTIONS = ("machine", "exact", "costs", "settings", "profile", "e2e", "real")
SHARES = {"machine": 0.05, "exact": 0.45, "costs": 0.3, "settings": 0.05, "profile": 0.05, "e2e": 0.15, "real": 0.15}
DEFAULT = SECTIONS[:-1]        # `real` runs when named: its GGUF is carried to the box separately (docs/gpu.md)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder for device_check.json and device_check.md (created; rewritten after each section).")
@click.option("--tiny", is_flag=True, help="Tiny shapes on whatever device: the CPU smoke mode CI runs (seconds).")
@click.option("--device", default=None, help="Default: cuda when a GPU is visible; otherwise --tiny is required.")
@click.option("--budget-s", default=480, type=click.IntRange(30), show_default=True,
              help="Wall-clock budget: each section gets its share and stops starting work past it.")
@click.option("--sections", default=",".join(DEFAULT), show_default=True,
              help=f"Comma-separated, run in this order; of {', '.join(SECTIONS)}.")
@click.option("--trees", default=None, type=click.IntRange(1),
              help="Random trees per exactness run (default: up to 1,000 on a GPU, 40 tiny, fewer for the "
                   "settings that differ).")
@click.option("--gguf", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The real model of the `real` section (default: SmolLM2-135M's data package where installed; "
                   "docs/gpu.md carries it to a GPU box in parts).")
def main(out_dir, tiny, device, budget_s, sections, trees, gguf):
    """What the CUDA path does, measured, in one unattended run: the card and its ceilings, exactness
    per setting (trees bit for bit, every strategy vs ar, batches, CUDA graphs vs eager, a
    chi-square), the step-cost curve of an 8B-shaped target, what each exactness setting costs it,
    where its one-token step's time goes (kernels, profiled), and the whole loop with forced
    acceptance, and a real model's GGUF under the product's settings (`real`). Each section is
    bounded in time; a failing one is one line in the report and the run
    goes on. Exit 0 when every section ran (its findings are in the report), 1 otherwise."""
    import torch

    from .timing import is_cuda
    names = [s.strip() for s in sections.split(",") if s.strip()]
    if bad := [s for s in names if s not in SECTIONS]:
        raise click.BadParameter(f"unknown section {bad[0]!r}; choose from {', '.join(SECTIONS)}",
                                 param_hint="--sections")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if is_cuda(device) and not torch.cuda.is_available():
        raise click.ClickException(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}, "
                                   f"CUDA {torch.version.cuda}); run on the GPU box, or add --tiny --device cpu")
    if not is_cuda(device) and not tiny:
        raise click.ClickException("no CUDA device here: the full check needs a GPU; "
                                   "run `--tiny` for the CPU smoke mode")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    res = {"started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "tiny": tiny, "device": device,
           "command": "python -m lab.device_check " + shlex.join(sys.argv[1:]), "sections": {}}
    ok = True
    share_left = sum(SHARES[n] for n in names)
    for name in names:
        now = time.monotonic()
        left = budget_s - (now - start)
        deadline = now + max(0.0, left * SHARES[name] / share_left)
        share_left -= SHARES[name]
        click.echo(f"device_check: {name} (until +{deadline - start:.0f} s of {budget_s} s)", err=True)
        res["sections"][name] = sec = run_section(name, device, tiny, deadline, trees, gguf)
        ok &= "error" not in sec
        if "error" in sec:
            click.echo(f"device_check: {name} FAILED: {sec['error']}", err=True)
        res["seconds"] = time.monotonic() - start
        save(out, res)
    click.echo(f"device_check: wrote {out / 'device_check.md'} and device_check.json "
               f"({res['seconds']:.0f} s{'' if ok else '; a section failed: see the report'})")
    sys.exit(0 if ok else 1)


def run_section(name: str, device: str, tiny: bool, deadline: float, trees: int | None,
                gguf: str | None = None) -> dict:
    t0 = time.monotonic()
    try:
        if name == "machine":
            from .machine import machine
            result = machine(device, tiny)
        elif name == "exact":
            from .exact import exact
            result = exact(device, tiny, deadline, trees)
        elif name == "costs":
            from .costs import costs
            result = costs(device, tiny, deadline)
        elif name == "settings":
            from .setcost import setting_costs
            result = setting_costs(device, tiny, deadline)
        elif name == "profile":
            from .profile import profile
            result = profile(device, tiny, deadline)
        elif name == "e2e":
            from .e2e import e2e
            result = e2e(device, tiny, deadline)
        else:
            from .real import real
            result = real(device, tiny, deadline, gguf, trees)
            if "skipped" in result:
                return {"seconds": round(time.monotonic() - t0, 1), "skipped": result["skipped"]}
        return {"seconds": round(time.monotonic() - t0, 1), "result": result}
    except Exception as e:                       # noqa: BLE001 - one line in the report, the run goes on
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        return {"seconds": round(time.monotonic() - t0, 1),
                "error": f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})"[:500]}


def save(out: Path, res: dict) -> None:
    """The report, and the measured cost curve as a costs.json that `trtspec bench --plan-costs`
    plans with (the projection: these costs met by the acceptance of a real pair on any machine)."""
    from .costs import cost_model
    from .report import markdown
    write_atomic(out / "device_check.json", json.dumps(res, indent=1, default=str))
    write_atomic(out / "device_check.md", markdown(res))
    costs = res["sections"].get("costs", {}).get("result")
    if costs and (model := cost_model(costs, res["sections"].get("machine", {}).get("result"))):
        write_atomic(out / "device_costs.json", json.dumps(model, indent=1))


if __name__ == "__main__":
    main()
