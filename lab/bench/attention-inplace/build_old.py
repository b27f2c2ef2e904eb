"""Build an engine folder with the revision-1 attention (cat of past and new rows), for an A/B only.

    .venv/bin/python lab/bench/attention-inplace/build_old.py --config qwen2.5-coder-1.5b --output OLD_ENGINES
"""
import math, sys, torch
from trtspec.export import model as M
from trtspec.engines import manifest

def old_forward(self, x, cos, sin, mask_add, past_k, past_v):
    b, t = x.shape[0], x.shape[1]
    q = self.q_proj(x).view(b, t, self.h, self.d)
    k = self.k_proj(x).view(b, t, self.kv, self.d)
    v = self.v_proj(x).view(b, t, self.kv, self.d)
    q = q * cos + M.rotate_half(q) * sin
    k = k * cos + M.rotate_half(k) * sin
    keys = torch.cat([past_k, k], 1)
    values = torch.cat([past_v, v], 1)
    g = self.h // self.kv
    qg = q.view(b, t, self.kv, g, self.d).permute(0, 2, 3, 1, 4)
    kg = keys.permute(0, 2, 1, 3).unsqueeze(2)
    vg = values.permute(0, 2, 1, 3).unsqueeze(2)
    scores = torch.matmul(qg, kg.transpose(-1, -2)).float() * (1.0 / math.sqrt(self.d)) + mask_add
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, vg)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, t, self.h * self.d)
    return self.o_proj(out), k, v

M.Attention.forward = old_forward
manifest.GRAPH_REVISION = 1
from trtspec.cli import main
sys.argv = ["trtspec", "build", *sys.argv[1:]]
main()
