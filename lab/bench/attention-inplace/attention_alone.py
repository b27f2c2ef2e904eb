"""Attention alone, three ways (docs/benchmarks.md, "Attention without the copy"): one layer of the
Qwen2.5 1.5B's attention shape (12 query heads, 2 KV heads, D = 128, fp32), 8 layers per graph.

    cat_attn     graph revision 1: cat the past with the new rows, attend over the result
    split_attn   graph revision 2 (export/model.py): scores against past and new apart, joined, one softmax
    split2_attn  the rejected variant: a two-part softmax with no join

Prints ms per layer in ONNX Runtime (dynamo export, opset 18) and torch eager, 2 threads.
    .venv/bin/python lab/bench/attention-inplace/attention_alone.py
"""
import math, tempfile, time, torch, numpy as np, onnxruntime as ort
TMP = tempfile.mkdtemp()
from torch import nn
H, KV, D = 12, 2, 128
G = H // KV
LAYERS = 8

def cat_attn(q, pk, pv, k, v, mask_add):
    b, t = q.shape[0], q.shape[1]
    keys = torch.cat([pk, k], 1); values = torch.cat([pv, v], 1)
    qg = q.view(b, t, KV, G, D).permute(0, 2, 3, 1, 4)
    kg = keys.permute(0, 2, 1, 3).unsqueeze(2); vg = values.permute(0, 2, 1, 3).unsqueeze(2)
    s = torch.matmul(qg, kg.transpose(-1, -2)) * (1 / math.sqrt(D)) + mask_add[:, None, None]
    p = torch.softmax(s, -1)
    return torch.matmul(p, vg).permute(0, 3, 1, 2, 4).reshape(b, t, H * D)

def split_attn(q, pk, pv, k, v, mask_add):
    b, t, c = q.shape[0], q.shape[1], pk.shape[1]
    qg = q.view(b, t, KV, G, D).permute(0, 2, 3, 1, 4).reshape(b, KV, G * t, D)
    kp = pk.permute(0, 2, 3, 1); kn = k.permute(0, 2, 3, 1)   # [B, KV, D, C]
    s = torch.cat([qg @ kp, qg @ kn], -1).view(b, KV, G, t, c + t) * (1 / math.sqrt(D)) + mask_add[:, None, None]
    p = torch.softmax(s, -1).view(b, KV, G * t, c + t)
    out = p[..., :c] @ pv.permute(0, 2, 1, 3) + p[..., c:] @ v.permute(0, 2, 1, 3)
    return out.view(b, KV, G, t, D).permute(0, 3, 1, 2, 4).reshape(b, t, H * D)


def split2_attn(q, pk, pv, k, v, mask_add):
    b, t, c = q.shape[0], q.shape[1], pk.shape[1]
    qg = q.view(b, t, KV, G, D).permute(0, 2, 3, 1, 4).reshape(b, KV, G * t, D)
    mp, mn = mask_add[..., :c][:, None, None], mask_add[..., c:][:, None, None]
    sp = (qg @ pk.permute(0, 2, 3, 1)).view(b, KV, G, t, c) * (1 / math.sqrt(D)) + mp
    sn = (qg @ k.permute(0, 2, 3, 1)).view(b, KV, G, t, t) * (1 / math.sqrt(D)) + mn
    m = torch.maximum(sp.amax(-1, keepdim=True), sn.amax(-1, keepdim=True))
    ep, en = torch.exp(sp - m), torch.exp(sn - m)
    den = ep.sum(-1, keepdim=True) + en.sum(-1, keepdim=True)
    out = (ep.view(b, KV, G * t, c) @ pv.permute(0, 2, 1, 3) + en.view(b, KV, G * t, t) @ v.permute(0, 2, 1, 3))
    out = out / den.view(b, KV, G * t, 1)
    return out.view(b, KV, G, t, D).permute(0, 3, 1, 2, 4).reshape(b, t, H * D)

class M(nn.Module):
    def __init__(self, f): super().__init__(); self.f = f
    def forward(self, q, mask_add, *kv):
        out = q.reshape(q.shape[0], q.shape[1], H * D)
        acc = out
        for i in range(LAYERS):
            pk, pv = kv[2*i], kv[2*i+1]
            k = out[..., :KV*D].reshape(out.shape[0], out.shape[1], KV, D); v = k + 1
            acc = acc + self.f(out.view(out.shape[0], out.shape[1], H, D), pk, pv, k, v, mask_add)
        return acc

def inputs(b, t, c):
    q = torch.randn(b, t, H, D)
    mask = torch.ones(b, t, c + t, dtype=torch.bool).tril(c)
    mask_add = torch.where(mask, 0.0, -1e30)
    kv = [torch.randn(b, c, KV, D) for _ in range(2 * LAYERS)]
    return q, mask_add, kv

torch.manual_seed(0)
q, m, kv = inputs(2, 3, 5)
ref = M(cat_attn)(q, m, *kv)
for f in (split_attn, split2_attn):
    print(f.__name__, (M(f)(q, m, *kv) - ref).abs().max().item())

torch.set_num_threads(2)
sess = {}
for f in (cat_attn, split_attn, split2_attn):
    B, T, C = torch.export.Dim("b"), torch.export.Dim("t"), torch.export.Dim("c", min=0)
    shapes = {"q": {0: B, 1: T}, "mask_add": {0: B, 1: T, 2: torch.export.Dim.AUTO}, "kv": tuple({0: B, 1: C} for _ in range(2*LAYERS))}
    p = torch.onnx.export(M(f), (q, m, *kv), dynamo=True, opset_version=18, dynamic_shapes=shapes, verbose=False)
    p.save(f"{TMP}/{f.__name__}.onnx")
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    sess[f.__name__] = ort.InferenceSession(f"{TMP}/{f.__name__}.onnx", so)
names = [i.name for i in sess["cat_attn"].get_inputs()]
for b, t, c in [(1, 1, 256), (1, 1, 1024), (1, 1, 2048), (1, 16, 1024), (4, 1, 1024), (1, 256, 512), (1, 256, 1440)]:
    q, m, kv = inputs(b, t, c)
    feed = dict(zip(names, [x.numpy() for x in (q, m, *kv)]))
    row = []
    outs = {}
    for name, s in sess.items():
        for _ in range(3): outs[name] = s.run(None, feed)[0]
        t0 = time.perf_counter(); n = 20
        for _ in range(n): s.run(None, feed)
        row.append(f"ort {name} {(time.perf_counter()-t0)/n*1e3/LAYERS:.3f}")
    for f in (cat_attn, split_attn, split2_attn):
        mod = M(f)
        with torch.no_grad():
            for _ in range(3): mod(q, m, *kv)
            t0 = time.perf_counter(); n = 20
            for _ in range(n): mod(q, m, *kv)
        row.append(f"torch {f.__name__} {(time.perf_counter()-t0)/n*1e3/LAYERS:.3f}")
    print((b, t, c), "; ".join(row), "| ort split diff", np.abs(outs["split_attn"]-outs["cat_attn"]).max(), np.abs(outs["split2_attn"]-outs["cat_attn"]).max())
