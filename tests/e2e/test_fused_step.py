"""The logical engine's step in a few kernels (engines/fused_step.py, fused_blocks.py; issue 61 part 3)
on the CPU under TRITON_INTERPRET=1: the same weights and outputs as the Decoder, in at most ten
kernels a layer.

- the fused blocks round where torch's own ops round: the residual sum and the rotary (keys written
  into the pool, values as they are) bit for bit against export/model.py's ops, the norm, SiLU and
  GeGLU within an ulp;
- the joined products are views of the weights the Decoder reads (no second copy, same values);
- a prompt and the steps after it give the eager Decoder's logits (fp32, to 1e-5) for each family
  the engine takes: biases (qwen2), q/k norms (qwen3), partial rotary (phi3), routed experts, Gemma 3
  (sliding windows by logical position, sandwich norms, GeGLU, its own scores' scale);
- kernels per layer, counted as the profiler would on a GPU (each Triton launch one, each torch op
  that computes one; views and allocations none), as the difference between a 4- and a 2-layer
  model: at most 10 for the fused step, where the Decoder's own eager step takes far more.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from lab.device_check.profile import NOT_COMPUTE  # noqa: E402
from trtspec.engines import fused_blocks, logical_attention  # noqa: E402
from trtspec.engines.fused_blocks import act_mul, add_rms_norm, rope_write  # noqa: E402
from trtspec.engines.logical_engine import LogicalTorchEngine  # noqa: E402
from trtspec.engines.torch_engine import TorchEngine  # noqa: E402
from trtspec.export.tiny import tiny_pair, tiny_spec  # noqa: E402

pytestmark = pytest.mark.slow


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between two bf16 tensors."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    return int((ia - ib).abs().max())


def test_blocks_round_where_torch_rounds():
    target, _ = tiny_pair(tiny_spec("llama"), seed=0, dtype=torch.bfloat16)
    layer = target.model.layers[0]
    g = torch.Generator().manual_seed(1)
    x, h = (torch.randn(6, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    total, normed = add_rms_norm(x, h, layer.input_layernorm)
    assert torch.equal(total, x + h)
    assert _ulps(normed, layer.input_layernorm(x + h)) <= 1
    gate_up = torch.randn(6, 2 * 128, generator=g).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, -1)
    assert _ulps(act_mul(gate_up), torch.nn.functional.silu(gate) * up) <= 1
    assert _ulps(act_mul(gate_up, tanh_gelu=True), torch.nn.functional.gelu(gate, approximate="tanh") * up) <= 1

    # rotary + the KV write against Attention.project: q and k bit for bit, v as it is
    spec, attn = target.spec, layer.self_attn
    pos = torch.tensor([[3, 4, 9]])
    cos, sin = target.rotary(target.inv_freq, pos, torch.bfloat16)
    y = torch.randn(1, 3, 64, generator=g).to(torch.bfloat16)
    q_ref, k_ref, v_ref = attn.project(y, (cos, sin))
    qkv = torch.cat([attn.q_proj(y), attn.k_proj(y), attn.v_proj(y)], -1).view(3, -1)
    kp, vp = (torch.zeros(2, spec.num_kv_heads, 8, spec.head_dim, dtype=torch.bfloat16) for _ in range(2))
    q = rope_write(qkv, cos.view(3, -1), sin.view(3, -1), (spec.num_heads, spec.num_kv_heads, spec.head_dim), None,
                   kp, vp, torch.tensor([1, 1, 1]), torch.tensor([5, 6, 7]), torch.bfloat16)
    assert torch.equal(q, q_ref[0])
    assert torch.equal(kp[1, :, 5:8], k_ref[0].transpose(0, 1)) and torch.equal(vp[1, :, 5:8], v_ref[0].transpose(0, 1))
    assert not kp[0].any() and not kp[1, :, :5].any()          # nothing written outside the rows named


def test_weights_are_joined_in_place():
    target, _ = tiny_pair(tiny_spec("qwen2"), seed=0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    eng = LogicalTorchEngine(target)
    attn, mlp, joined = target.model.layers[1].self_attn, target.model.layers[1].mlp, eng.joined[1]
    assert attn.k_proj.weight.untyped_storage().data_ptr() == joined.qkv.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == joined.gate_up.untyped_storage().data_ptr()
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


@pytest.mark.parametrize("arch,rotary", [("llama", None), ("qwen2", None), ("qwen3", None), ("phi3", 8),
                                         ("qwen3_moe", None), ("gemma3", None)])
def test_logits_equal_the_decoders(arch, rotary):
    """A 13-token prompt, then three one-token steps, each row's logits against the eager Decoder's
    (fp32); Gemma 3's windowed layers see 12 keys, so the prompt's last rows and the steps are cut."""
    target, _ = tiny_pair(tiny_spec(arch, rotary_dim=rotary), seed=0)
    fused, eager = LogicalTorchEngine(target), TorchEngine(target)
    caches = [fused.new_cache(32), eager.new_cache(32)]
    ids = torch.randint(0, target.spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    for lo, hi in ((0, 13), (13, 14), (14, 15), (15, 16)):
        t = hi - lo
        mask = torch.ones(1, t, hi, dtype=torch.bool)
        mask[0, :, lo:] = torch.ones(t, t, dtype=torch.bool).tril()
        args = (ids[:, lo:hi], torch.arange(lo, hi)[None], mask, torch.arange(t)[None])
        ours, ref = (e.step_batch([c], *args).clone() for e, c in zip((fused, eager), caches))
        assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max(), (lo, (ours - ref).abs().max())
        for c in caches:
            c.advance(t)
            c.commit(range(t))


class _Count(TorchDispatchMode):
    """Each torch op that computes (the profile's rule: views and allocations are not kernels, nor an
    op that returns its input)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name not in NOT_COMPUTE and not (args and out is args[0]):    # `to` its own dtype: none
            self.ops.append(func._schema.name)
        return out


class _Launches:
    """A Triton kernel whose launches are counted (and run outside the count: the interpreter's own
    copies are not the step's)."""

    def __init__(self, kernel, log: list):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            self.log.append("triton")
            with _disable_current_modes():
                return run(*args, **kwargs)
        return launch


def _kernels_per_step(arch: str, layers: int, fused: bool, monkeypatch) -> int:
    target, _ = tiny_pair(tiny_spec(arch, num_layers=layers), seed=0, dtype=torch.bfloat16)
    eng = LogicalTorchEngine(target) if fused else TorchEngine(target)
    cache = eng.new_cache(32)
    args = (torch.tensor([[5, 7, 9, 11]]), torch.arange(4)[None], torch.ones(1, 4, 4, dtype=torch.bool).tril(),
            torch.arange(4)[None])
    eng.step_batch([cache], *args)                       # the shape made, its kernels compiled
    log: list[str] = []
    monkeypatch.setattr(fused_blocks, "_KERNELS", {k: _Launches(v, log) for k, v in fused_blocks._kernels().items()})
    split, combine = logical_attention._kernels()
    monkeypatch.setattr(logical_attention, "_SPLIT_KERNEL", _Launches(split, log))
    monkeypatch.setattr(logical_attention, "_COMBINE_KERNEL", _Launches(combine, log))
    with torch.inference_mode(), _Count() as count:
        if fused:
            next(iter(eng.shapes.values())).body()       # the step's own body: what a CUDA graph replays
        else:
            target(*args, target.zero_past(1, 0))
    monkeypatch.undo()
    return len(count.ops) + len(log)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_at_most_ten_kernels_a_layer(arch, monkeypatch):
    per_layer = {fused: (_kernels_per_step(arch, 4, fused, monkeypatch)
                         - _kernels_per_step(arch, 2, fused, monkeypatch)) / 2 for fused in (True, False)}
    assert per_layer[True] <= 10, per_layer
    assert per_layer[False] > 20, per_layer              # the count sees what a layer of many kernels is
