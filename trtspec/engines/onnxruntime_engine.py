"""OrtEngine: the step contract run by ONNX Runtime, bound by pointer onto the KV pool.

Every step binds by pointer (IOBinding). One row: each KV head's past as the contiguous block
`buf[l, j, slot, h, :used]` and its new keys/values as *outputs* on `buf[l, j, slot, h, used:used+T]`,
so ORT writes them into the slot itself. B > 1 rows: each row's past is copied into one contiguous
block per layer and head, and the new rows are copied back into the slots (BatchStaging). The logits go into
one engine-owned float32 buffer, the caller's small int/bool tensors are bound as they are. One
IOBinding is reused and rebound (shapes change each step).
"""
from __future__ import annotations

import os

import onnx
import onnxruntime as ort
import torch

from ..export.contract import io_names
from ..export.spec import ModelSpec, SpecError
from ..runtime.engine import Engine
from ..runtime.kv_cache import BatchStaging, KVCache

_ONNX_TO_TORCH = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
                  onnx.TensorProto.BFLOAT16: torch.bfloat16, onnx.TensorProto.DOUBLE: torch.float64}
_TORCH_TO_ONNX = {v: k for k, v in _ONNX_TO_TORCH.items()} | {
    torch.int64: onnx.TensorProto.INT64, torch.bool: onnx.TensorProto.BOOL}
_SMALL_INPUTS = (("input_ids", torch.int64), ("position_ids", torch.int64),
                 ("attn_mask", torch.bool), ("logit_rows", torch.int64))


class OrtEngine(Engine):
    name = "onnxruntime"
    logits_in_own_buffer = True

    def __init__(self, onnx_path: str | os.PathLike, spec: ModelSpec, providers: list | None = None,
                 intra_op_threads: int | None = None, max_logit_rows: int = 64, allow_spinning: bool = False,
                 profile_prefix: str | None = None):
        self.spec = spec
        self.providers = providers or ["CPUExecutionProvider"]
        first = self.providers[0] if isinstance(self.providers[0], str) else self.providers[0][0]
        self.device = "cuda" if first == "CUDAExecutionProvider" else "cpu"
        # Read the KV dtype from the graph (weights stay on disk) to fail early and clearly.
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        kv = {v.name: v.type.tensor_type.elem_type for v in graph.input}.get("past_key.0.0")
        if kv not in _ONNX_TO_TORCH:
            raise SpecError(f"{onnx_path} is not a trtspec step graph (no float past_key.0.0 input)")
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
        if profile_prefix:              # ORT's own profiler: one JSON trace of every node (stepcost --profile)
            so.enable_profiling, so.profile_file_prefix = True, profile_prefix
        self.session = ort.InferenceSession(str(onnx_path), so, providers=self.providers)
        got = [i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()]
        self.hidden_rows = got[1][-1:] == ["hidden"]    # the graph also returns the rows its LM head read
        self.in_names, self.out_names = io_names(spec.num_layers, spec.num_kv_heads, self.hidden_rows)
        if got != (self.in_names, self.out_names):
            raise SpecError(f"{onnx_path} does not have the step interface of a {spec.num_layers}-layer model")
        self.io = self.session.io_binding()
        self._logits = torch.empty(max_logit_rows * spec.vocab_size, dtype=torch.float32, device=self.device)
        self._hidden = torch.empty(max_logit_rows * spec.hidden_size if self.hidden_rows else 0, device=self.device)
        self.staging = BatchStaging(spec, self.kv_dtype, self.device)

    def close(self) -> None:
        # The binding holds the session; the session owns ORT's intra-op thread pool, whose threads
        # are joined when it is released: here, in the order Generator.close() chooses, not in
        # whatever order interpreter teardown reaches them (docs/design.md, process lifecycle).
        self.io = self.session = self.staging = self._logits = self._hidden = self.hidden = None

    def step_batch(self, caches: list[KVCache], input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        (b, t), r = input_ids.shape, logit_rows.shape[1]
        c = attn_mask.shape[2] - t
        if b == 1 and c != caches[0].used:
            # One row binds its slot in place: a padded past would overlap the rows it writes.
            raise ValueError("the ONNX Runtime engine takes token buckets only, not cache-length buckets")
        self.check_room(caches, t)
        buf = caches[0].buf
        if buf.dtype != self.kv_dtype or buf.device.type != self.device or buf.dim() != 5 \
                or tuple(buf.shape[2::2]) != (self.spec.num_kv_heads, self.spec.head_dim) \
                or buf.stride(2) != buf[0, 0, 0].numel():
            raise ValueError(f"cache must be a slot of a {self.kv_dtype} pool on {self.device}; "
                             "make it with engine.new_pool()")
        n = b * r * self.spec.vocab_size
        if n > self._logits.numel():     # grow once to the new maximum; steady state never allocates
            self._logits = torch.empty(n, dtype=torch.float32, device=self.device)
        logits = self._logits[:n].view(b, r, self.spec.vocab_size)
        dev, idx = self.device, buf.device.index or 0
        io = self.io

        small = []  # keep converted tensors alive until run() returns
        for (name, dtype), x in zip(_SMALL_INPUTS, (input_ids, position_ids, attn_mask, logit_rows)):
            if x.dtype != dtype or not x.is_contiguous() or x.device != buf.device:
                x = x.to(device=buf.device, dtype=dtype).contiguous()
            small.append(x)
            io.bind_input(name, dev, idx, _TORCH_TO_ONNX[dtype], tuple(x.shape), x.data_ptr())

        elem = _TORCH_TO_ONNX[self.kv_dtype]
        hkv, d = self.spec.num_kv_heads, self.spec.head_dim
        if b == 1:
            # The slot's [l, j, h] blocks sit at fixed strides: compute the pointers instead of making
            # 4·L·Hkv tensor views per step. The past is bound in place and ORT writes the new rows
            # into the slot itself. A zero-row past (C=0) still gets a valid in-buffer pointer.
            used = caches[0].used
            e = buf.element_size()
            row, head, block = buf.stride(3) * e, buf.stride(2) * e, buf.stride(1) * e
            base = buf.data_ptr()
            for k in range(2 * self.spec.num_layers):  # k = 2*layer + (0: key, 1: value)
                for h in range(hkv):
                    start, i = base + k * block + h * head, k * hkv + h
                    io.bind_input(self.in_names[4 + i], dev, idx, elem, (1, used, d), start)
                    io.bind_output(self.out_names[1 + i], dev, idx, elem, (1, t, d), start + used * row)
        else:
            # Rows live in separate slots: their pasts are copied into one contiguous [B, C, D] block
            # per layer and head, and the new rows are scattered back after the run (BatchStaging).
            past, new = self.staging.past(caches, c), self.staging.new(b, t)
            for i in range(2 * self.spec.num_layers * hkv):
                io.bind_input(self.in_names[4 + i], dev, idx, elem, (b, c, d), past[i].data_ptr())
                io.bind_output(self.out_names[1 + i], dev, idx, elem, (b, t, d), new[i].data_ptr())
        io.bind_output("logits", dev, idx, onnx.TensorProto.FLOAT, tuple(logits.shape), logits.data_ptr())
        if self.hidden_rows:
            self.hidden = self._bind_hidden(b, r, dev, idx)

        self.session.run_with_iobinding(io)
        if b > 1:
            self.staging.scatter(caches, new)
        return logits

    def _bind_hidden(self, b: int, r: int, dev: str, idx: int) -> torch.Tensor:
        """The hidden rows' output, bound into one engine-owned buffer (grown to a new maximum once)."""
        n = b * r * self.spec.hidden_size
        if n > self._hidden.numel():
            self._hidden = torch.empty(n, dtype=torch.float32, device=self.device)
        hidden = self._hidden[:n].view(b, r, self.spec.hidden_size)
        self.io.bind_output("hidden", dev, idx, onnx.TensorProto.FLOAT, tuple(hidden.shape), hidden.data_ptr())
        return hidden
