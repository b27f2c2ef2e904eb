"""Why `staged` with the medusa head never feeds the draft model (docs/benchmarks.md, "A head as a model
role"): each step asks the budget whether a draft forward beats the head's tree (`_worth_feeding`);
this records its inputs (the draft's running top-1 acceptance, the catch-up charge) and answers on
the first HumanEval prompt, as it is, without the catch-up charge, and with the draft's top-1 at 0.75
(about what it measures where it runs). why_no_draft.txt: before the draft was measured beside a
head (`Round.measure`); why_no_draft_measured.txt: after.

    python why_no_draft.py FOLDER      # a folder built from qwen2.5-coder-1.5b-medusa.yaml
"""
import sys

import torch

from trtspec.assembly.load import load_generator
from trtspec.runtime.budget import auto
from trtspec.tools.datasets import load_prompts

torch.set_num_threads(2)
STRATEGY = "staged:suffix=false:drafter=medusa"
asked = []
worth = auto.AutoBudget._worth_feeding


def run(folder: str, label: str, catch_up: bool = True, top1: float | None = None) -> None:
    def spy(self, candidates, fed, tokens, ahead=1, hope=None):
        if not catch_up:
            self.catch_up_s = 0.0
        if top1 is not None:
            self.values.top1 = max(self.values.top1, top1)
        got = worth(self, candidates, fed, tokens, ahead, hope)
        asked.append((round(self.values.top1, 3), round(self.catch_up_s * 1e3, 1), got))
        return got

    auto.AutoBudget._worth_feeding = spy
    asked.clear()
    gen = load_generator(folder)
    try:
        ids = gen.tokenizer(load_prompts("humaneval", limit=1)[0].text)["input_ids"]
        r = gen.generate(ids, strategy=STRATEGY, max_new_tokens=48)
    finally:
        gen.close()
    print(f"{label}: {len(r.steps)} steps, {sum(s.draft_forwards for s in r.steps)} draft forwards; asked "
          f"{len(asked)} times, fed {sum(a[-1] for a in asked)}; (draft top-1, catch-up ms, fed) first "
          f"{asked[:2]}, last {asked[-1:]}")


if __name__ == "__main__":
    run(sys.argv[1], "as it is")
    run(sys.argv[1], "without the catch-up charge", catch_up=False)
    run(sys.argv[1], "without it, the draft's top-1 at 0.75", catch_up=False, top1=0.75)
