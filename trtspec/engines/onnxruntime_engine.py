"""OrtEngine: the step contract run by ONNX Runtime, bound straight onto the KVCache buffer.

Every step binds by pointer (IOBinding): the past as the contiguous block `buf[l, j, :used]`, the
new keys/values as *outputs* on `buf[l, j, used:used+T]` so ORT writes them into the cache itself,
the logits into one engine-owned float32 buffer, and the caller's small int/bool tensors as they
are. No per-step numpy/torch copies; one IOBinding is reused and rebound (shapes change each step).
"""
from __future__ import annotations

import os

import onnx
import onnxruntime as ort
import torch

from ..export.onnx_export import io_names
from ..export.spec import ModelSpec, SpecError
from ..runtime.kv_cache import KVCache
from .base import Engine

_ONNX_TO_TORCH = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
                  onnx.TensorProto.BFLOAT16: torch.bfloat16}
_TORCH_TO_ONNX = {v: k for k, v in _ONNX_TO_TORCH.items()} | {
    torch.int64: onnx.TensorProto.INT64, torch.bool: onnx.TensorProto.BOOL}
_SMALL_INPUTS = (("input_ids", torch.int64), ("position_ids", torch.int64),
                 ("attn_mask", torch.bool), ("logit_rows", torch.int64))


class OrtEngine(Engine):
    name = "onnxruntime"

    def __init__(self, onnx_path: str | os.PathLike, spec: ModelSpec, providers: list | None = None,
                 intra_op_threads: int | None = None, max_logit_rows: int = 64, allow_spinning: bool = False):
        self.spec = spec
        self.providers = providers or ["CPUExecutionProvider"]
        first = self.providers[0] if isinstance(self.providers[0], str) else self.providers[0][0]
        self.device = "cuda" if first == "CUDAExecutionProvider" else "cpu"
        # Read the KV dtype from the graph (weights stay on disk) to fail early and clearly.
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        kv = {v.name: v.type.tensor_type.elem_type for v in graph.input}.get("past_key.0")
        if kv not in _ONNX_TO_TORCH:
            raise SpecError(f"{onnx_path} is not a trtspec step graph (no float past_key.0 input)")
        self.kv_dtype = _ONNX_TO_TORCH[kv]
        if self.kv_dtype == torch.bfloat16 and self.device == "cpu":
            raise SpecError("ONNX Runtime's CPU provider has no bfloat16 kernels (Mul, MatMul, ...): run "
                            "bf16 models with the torch or TensorRT backend, or export in float16/float32")

        so = ort.SessionOptions()
        so.intra_op_num_threads = intra_op_threads or torch.get_num_threads()
        # ORT's pool threads spin between ops by default; between steps the Python decoding loop
        # needs those cores (and on a shared 2-core box spinning doubled step time). Opt back in
        # with allow_spinning=True on dedicated cores.
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        self.session = ort.InferenceSession(str(onnx_path), so, providers=self.providers)
        self.in_names, self.out_names = io_names(spec.num_layers)
        got = [i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()]
        if got != (self.in_names, self.out_names):
            raise SpecError(f"{onnx_path} does not have the step interface of a {spec.num_layers}-layer model")
        self.io = self.session.io_binding()
        self._logits = torch.empty(max_logit_rows, spec.vocab_size, dtype=torch.float32, device=self.device)

    def step(self, cache: KVCache, input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        t, r, used = input_ids.shape[0], logit_rows.shape[0], cache.used
        if attn_mask.shape[1] != used + t:
            # Padding the past would bind outputs inside the past's block; T-buckets are fine.
            raise ValueError("the ONNX Runtime engine takes token buckets only, not cache-length buckets")
        if used + t > cache.capacity:
            cache.slots(t)  # raises the cache's CapacityError with its user-facing message
        buf = cache.buf
        if buf.dtype != self.kv_dtype or buf.device.type != self.device or not buf.is_contiguous():
            raise ValueError(f"cache must be a contiguous {self.kv_dtype} buffer on {self.device}; "
                             "make it with engine.new_cache()")
        if r > self._logits.shape[0]:  # grow once to the new maximum; steady state never allocates
            self._logits = torch.empty(r, self.spec.vocab_size, dtype=torch.float32, device=self.device)
        dev, idx = self.device, buf.device.index or 0
        io = self.io

        small = []  # keep converted tensors alive until run() returns
        for (name, dtype), x in zip(_SMALL_INPUTS, (input_ids, position_ids, attn_mask, logit_rows)):
            if x.dtype != dtype or not x.is_contiguous() or x.device != buf.device:
                x = x.to(device=buf.device, dtype=dtype).contiguous()
            small.append(x)
            io.bind_input(name, dev, idx, _TORCH_TO_ONNX[dtype], tuple(x.shape), x.data_ptr())

        # buf[L, 2, S, Hkv, D] is contiguous, so buf[l, j, row] sits at a fixed stride: compute the
        # pointers instead of making 4L tensor views per step. A zero-row past (C=0) still gets a
        # valid in-buffer pointer, which ORT accepts for an empty tensor.
        elem = _TORCH_TO_ONNX[self.kv_dtype]
        row = buf.stride(2) * buf.element_size()
        base, block = buf.data_ptr(), buf.stride(1) * buf.element_size()
        hkv, d = self.spec.num_kv_heads, self.spec.head_dim
        for n in range(2 * self.spec.num_layers):  # n = 2*layer + (0: key, 1: value), as in buf[:, :]
            start = base + n * block
            io.bind_input(self.in_names[4 + n], dev, idx, elem, (used, hkv, d), start)
            io.bind_output(self.out_names[1 + n], dev, idx, elem, (t, hkv, d), start + used * row)
        logits = self._logits[:r]
        io.bind_output("logits", dev, idx, onnx.TensorProto.FLOAT, (r, self.spec.vocab_size), logits.data_ptr())

        self.session.run_with_iobinding(io)
        cache.advance(t)
        return logits
