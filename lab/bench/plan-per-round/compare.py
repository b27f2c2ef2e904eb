"""The speed tables of docs/benchmarks.md, "One question per round", from the runs' results.json:

    python lab/bench/plan-per-round/compare.py before1 after1 before2 after2
    python lab/bench/plan-per-round/compare.py before_dc after_dc
    python lab/bench/plan-per-round/compare.py docs/bench/redesign-3/{before1,after1,before2,after2}

(a name: a run recorded beside this script's records, docs/bench/plan-per-round/; a path: any run)

Every strategy of a run is compared with the first run named (its tokens, token for token) and with
the run's own `ar` (every output of a lossless strategy equals it). Non-forward time is
(seconds - forward_seconds) / new tokens: the runtime's own time outside the model forwards.
"""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parents[3] / "docs" / "bench" / Path(__file__).parent.name   # the records


def ids(d: dict, strategy: str) -> dict:
    return {p["id"]: p["runs"][strategy]["token_ids"] for p in d["prompts"]}


def load(run: str) -> dict:
    folder = Path(run) if Path(run, "results.json").is_file() else here / run
    return json.load(open(folder / "results.json"))


def main(runs: list[str]) -> None:
    first = load(runs[0])
    print("| run | start (UTC) | strategy | tok/s | × ar | non-forward ms/token | target steps / draft forwards "
          "| mean accepted | outputs = ar | outputs = first run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in runs:
        d = load(name)
        ar = d["aggregate"]["ar"]
        for s, x in d["aggregate"].items():
            nf = (x["seconds"] - x["forward_seconds"]) / x["new_tokens"] * 1e3
            mine, base = ids(d, s), ids(d, "ar")
            same_ar = sum(mine[k] == base[k] for k in mine)
            same_first = sum(mine[k] == v for k, v in ids(first, s).items())
            print(f"| {Path(name).name} | {d['machine']['date'][11:19]} | `{s}` | {x['tokens_per_s']:.2f} | "
                  f"{x['tokens_per_s'] / ar['tokens_per_s']:.2f} | {nf:.2f} | {x['target_steps']} / "
                  f"{x['draft_forwards']} | {x['mean_accepted']:.2f} | {same_ar}/{len(mine)} | "
                  f"{same_first}/{len(mine)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
