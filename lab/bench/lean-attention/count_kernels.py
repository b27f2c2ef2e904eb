"""Count the ATen ops (views excluded) one layer of a Llama-3-8B-shaped Decoder runs, with exact
attention: each is a kernel launch on a GPU.

    python lab/bench/lean-attention/count_kernels.py CHECKOUT

CHECKOUT: a trtspec checkout (25da235, or one with lean-attention.patch applied). Prints, for a
one-token step and a 16-node step at 64 cached rows, the ops of a 2-layer model minus a 1-layer one.
"""
import collections
import sys

import torch

sys.path.insert(0, sys.argv[1])
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from trtspec.export.model import Decoder  # noqa: E402
from trtspec.export.spec import ModelSpec  # noqa: E402
from trtspec.export.tiny import random_state  # noqa: E402

VIEWS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "permute", "transpose", "t", "expand",
         "slice", "select", "split", "split_with_sizes", "unbind", "alias", "detach", "as_strided", "narrow",
         "chunk", "_reshape_alias"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def model(layers: int) -> Decoder:
    spec = ModelSpec(arch="llama", vocab_size=256, hidden_size=4096, intermediate_size=64, num_layers=layers,
                     num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e5, attention_bias=False,
                     tie_word_embeddings=False)
    return Decoder.from_state(spec, random_state(spec, 0), torch.float32).exact_attention()


def ops(m: Decoder, t: int, c: int) -> collections.Counter:
    past = [torch.zeros(1, c, 128, dtype=torch.float64) for _ in m.zero_past(1, c)]
    mask = torch.ones(1, t, c + t, dtype=torch.bool)
    with torch.no_grad(), Count() as count:
        m(torch.zeros(1, t, dtype=torch.long), c + torch.arange(t)[None], mask, torch.arange(t)[None], past)
    return count.ops


one, two = model(1), model(2)
for t in (1, 16):
    layer = ops(two, t, 64) - ops(one, t, 64)
    print(f"T={t}: {sum(layer.values())} ops per layer", dict(layer.most_common(12)))
