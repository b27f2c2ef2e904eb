"""OrtCudaGraphEngine: ONNX Runtime's CUDA execution provider with one CUDA graph per bucket.

NOT EXERCISED IN CI, NOR ANYWHERE YET (no GPU, and onnxruntime-gpu is an optional extra). Written
to ONNX Runtime's documented CUDA-graph rules (../shared/research/anchors.md §3): every input and
output bound through IOBinding to device memory whose address and shape never change for a graph,
`enable_cuda_graph` in the provider options, and the run option `gpu_graph_id` choosing the graph
(one id per bucketed step shape; 0 is reserved, so ids start at 1). The first run with a new id
captures; later runs replay. New keys/values go to staging buffers (StagedBucket) and are scattered
into the rows' slots after each run (the slots and rows move every step); the past is staged too.
"""
from __future__ import annotations

import os

import onnx
import torch

from ..export.contract import io_names
from ..export.spec import ModelSpec, SpecError
from ..runtime.engine import Engine
from ..runtime.kv_cache import KVCache
from .staging import StagedBucket, after_inputs

_ELEM = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
         torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
         torch.bool: onnx.TensorProto.BOOL}


class OrtCudaGraphEngine(Engine):
    name = "onnxruntime-cuda"
    logits_in_own_buffer = True

    def __init__(self, onnx_path: str | os.PathLike, spec: ModelSpec, kv_dtype: torch.dtype, device_id: int = 0):
        import onnxruntime as ort

        self.ort, self.spec, self.kv_dtype, self.device, self.device_id = ort, spec, kv_dtype, "cuda", device_id
        providers = [("CUDAExecutionProvider", {"device_id": device_id, "enable_cuda_graph": "1"})]
        self.session = ort.InferenceSession(str(onnx_path), providers=providers)
        if [o.name for o in self.session.get_outputs()][-1:] == ["hidden"]:
            raise SpecError(f"{onnx_path} returns hidden rows, which the CUDA engine does not bind yet; run it "
                            "with the onnxruntime (CPU) or torch backend")
        self.in_names, self.out_names = io_names(spec.num_layers, spec.num_kv_heads)
        self.buckets: dict[tuple, tuple[StagedBucket, object, object]] = {}

    def close(self) -> None:
        self.buckets.clear()                         # bindings (and their captured graphs) before the session
        self.session = None

    def step_batch(self, caches: list[KVCache], input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        (b, t), total, r = input_ids.shape, attn_mask.shape[2], logit_rows.shape[1]
        self.check_room(caches, t)
        key = (b, t, total, r)
        if key not in self.buckets:
            self.buckets[key] = self._bucket(b, t, total, r, graph_id=len(self.buckets) + 1)
        g, io, run_options = self.buckets[key]
        g.load(caches, input_ids, position_ids, attn_mask, logit_rows)
        after_inputs()                               # ORT's own stream must see the copies
        self.session.run_with_iobinding(io, run_options)
        g.scatter_new_kv(caches)
        return g.logits

    def _bucket(self, b: int, t: int, total: int, r: int, graph_id: int):
        g = StagedBucket.make(self.spec, self.kv_dtype, "cuda", b, t, total, r)
        io = self.session.io_binding()

        def bind(fn, name: str, x: torch.Tensor) -> None:
            fn(name, "cuda", self.device_id, _ELEM[x.dtype], tuple(x.shape), x.data_ptr())

        for name, x in g.inputs.items():
            bind(io.bind_input, name, x)
        for k in range(2 * self.spec.num_layers * self.spec.num_kv_heads):
            bind(io.bind_input, self.in_names[4 + k], g.past[k])
            bind(io.bind_output, self.out_names[1 + k], g.new_kv[k])
        bind(io.bind_output, "logits", g.logits)
        run_options = self.ort.RunOptions()
        run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return g, io, run_options
