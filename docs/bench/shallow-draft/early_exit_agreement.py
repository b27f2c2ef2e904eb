"""How often an early-exit self-draft (a model's first N layers with its own final norm and LM head:
`draft: {model: M, layers: N}`) predicts the target's next greedy token, teacher-forced on the
target's own outputs: one fp32 forward of model M per prompt, the hidden state after layer N put
through the final norm and head (exactly the N-layer model's logits).

    python docs/bench/shallow-draft/early_exit_agreement.py RESULTS.json MODEL [N ...]

MODEL: pack:qwen2.5-coder-0.5b (the default draft) or pack:qwen2.5-coder-1.5b (the target itself).

RESULTS.json: a `trtspec bench` record with an `ar` runner (its prompts and greedy outputs).
Prints, per N, the share of the outputs' positions where the N-layer draft's argmax is the target's
token (the first token of each output excluded: it follows the prompt alone)."""
import json
import sys

import torch

from trtspec.assembly.config import ModelEntry
from trtspec.assembly.sources import load_model, load_tokenizer_for
from trtspec.runtime.prompts import encode
from trtspec.tools.datasets import load_prompts

results = json.load(open(sys.argv[1]))
depths = [int(x) for x in sys.argv[3:]] or [8, 12, 16, 20, 24]
entry = ModelEntry(model=sys.argv[2])
model, tok = load_model(entry, "draft"), load_tokenizer_for(entry)
prompts = {p.id: p for p in load_prompts(results["settings"]["dataset"])}
torch.set_num_threads(2)
hits = {n: 0 for n in depths}
total = 0
for rec in results["prompts"]:
    out = rec["runs"]["ar"]["token_ids"]
    ids = encode(prompts[rec["id"]], tok, chat=rec["chat"]) + out
    x = model.model.embed_tokens(torch.tensor([ids]))
    t = x.shape[1]
    freqs = torch.arange(t).float().unsqueeze(-1) * model.inv_freq
    emb = torch.cat([freqs, freqs], -1)[None, :, None]
    cos, sin = emb.cos(), emb.sin()
    mask_add = torch.where(torch.ones(t, t, dtype=torch.bool).tril(), 0.0, -1e30)[None, None, None]
    empty = [torch.zeros(1, 0, model.spec.head_dim)] * model.spec.num_kv_heads
    first = len(ids) - len(out)                  # position of the first output token
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers, 1):
            h, _, _ = layer.self_attn(layer.input_layernorm(x), cos, sin, mask_add, empty, empty)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in hits:
                # rows first .. end-2 predict output tokens 1 .. end-1
                pred = model.lm_head(model.model.norm(x[0, first:-1])).argmax(-1)
                hits[i] += int((pred == torch.tensor(out[1:])).sum())
    total += len(out) - 1
agreement = {n: round(hits[n] / total, 4) for n in depths}
print(json.dumps({"model": sys.argv[2], "positions": total, "top1_agreement": agreement}))
