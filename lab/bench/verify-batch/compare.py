"""The speed table of docs/benchmarks.md, "One verification per batch", from the runs' results.json:

    python lab/bench/verify-batch/compare.py before1 after1 after2 final1 before2 final2

The first run named is the one every output is compared with, token for token. Non-forward time is
(seconds - forward_seconds) / new tokens: the runtime's own time outside the model forwards.
"""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parents[3] / "docs" / "bench" / Path(__file__).parent.name   # the records


def ids(d: dict) -> dict:
    return {(p["id"], r): p["runs"][r]["token_ids"] for p in d["prompts"] for r in p["runs"]}


def main(runs: list[str]) -> None:
    first = ids(json.load(open(here / runs[0] / "results.json")))
    print("| run | start (UTC) | `ar` tok/s | `staged` tok/s | `staged` × ar | non-forward ms/token (ar / staged) "
          "| target steps / draft forwards | outputs = first run |")
    print("|---|---|---|---|---|---|---|---|")
    for name in runs:
        d = json.load(open(here / name / "results.json"))
        a, s = d["aggregate"]["ar"], d["aggregate"]["staged"]
        nf = lambda x: (x["seconds"] - x["forward_seconds"]) / x["new_tokens"] * 1e3  # noqa: E731
        same = sum(v == first.get(k) for k, v in ids(d).items())
        print(f"| {name} | {d['machine']['date'][11:19]} | {a['tokens_per_s']:.2f} | {s['tokens_per_s']:.2f} | "
              f"{s['tokens_per_s'] / a['tokens_per_s']:.2f} | {nf(a):.2f} / {nf(s):.2f} | "
              f"{s['target_steps']} / {s['draft_forwards']} | {same}/{len(first)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
