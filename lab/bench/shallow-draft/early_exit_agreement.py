"""How often an early-exit self-draft (a model's first N layers with its own final norm and LM head:
`draft: {model: M, layers: N}`) predicts the target's next greedy token, teacher-forced on the
target's own outputs: the N-layer Decoder the build would make (assembly/sources.truncate_layers),
fp32, one causal forward per prompt over the prompt and the output.

    python lab/bench/shallow-draft/early_exit_agreement.py RESULTS.json MODEL [N ...]

RESULTS.json: a `trtspec bench` record with an `ar` runner (its prompts and greedy outputs).
MODEL: pack:qwen2.5-coder-0.5b (the default draft) or pack:qwen2.5-coder-1.5b (the target itself).
Prints, per N, the share of the outputs' positions where the N-layer model's argmax is the target's
token (the first token of each output excluded: it follows the prompt alone)."""
import json
import sys

import torch

from trtspec.assembly.config import ModelEntry
from trtspec.assembly.sources import load_tokenizer_for, truncate_layers
from trtspec.export.checkpoint import load_checkpoint
from trtspec.export.model import Decoder
from trtspec.export.packs import resolve_model
from trtspec.runtime.prompts import encode
from trtspec.tools.datasets import load_prompts

results = json.load(open(sys.argv[1]))
entry = ModelEntry(model=sys.argv[2])
spec, state = load_checkpoint(resolve_model(entry.model))
depths = [int(x) for x in sys.argv[3:]] or [8, 12, 16, 20, 24]
tok = load_tokenizer_for(entry)
prompts = {p.id: p for p in load_prompts(results["settings"]["dataset"])}
torch.set_num_threads(2)
agreement, total = {}, 0
for n in depths:
    model = Decoder.from_state(*truncate_layers(spec, state, n), torch.float32) if n < spec.num_layers \
        else Decoder.from_state(spec, state, torch.float32)
    hits, total = 0, 0
    for rec in results["prompts"]:
        out = rec["runs"]["ar"]["token_ids"]
        ids = encode(prompts[rec["id"]], tok, chat=rec["chat"]) + out
        t, first = len(ids), len(ids) - len(out)     # first: the position of the first output token
        rows = torch.arange(first, t - 1)[None]      # rows first .. t-2 predict output tokens 1 .. end
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]), torch.arange(t)[None],
                              torch.ones(t, t, dtype=torch.bool).tril()[None], rows, model.zero_past())
        hits += int((logits[0].argmax(-1) == torch.tensor(out[1:])).sum())
        total += len(out) - 1
    agreement[n] = round(hits / total, 4)
print(json.dumps({"model": sys.argv[2], "positions": total, "top1_agreement": agreement}))
