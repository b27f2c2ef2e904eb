"""OrtCudaGraphEngine: ONNX Runtime's CUDA execution provider with one CUDA graph per bucket.

NOT EXERCISED IN CI, NOR ANYWHERE YET (no GPU, and onnxruntime-gpu is an optional extra). Written
to ONNX Runtime's documented CUDA-graph rules (../shared/research/anchors.md §3): every input and
output bound through IOBinding to device memory whose address and shape never change for a graph,
`enable_cuda_graph` in the provider options, and the run option `gpu_graph_id` choosing the graph
(one id per bucketed step shape; 0 is reserved, so ids start at 1). The first run with a new id
captures; later runs replay. New keys/values go to staging buffers (StagedBucket) and are scattered
into the cache after each run, since the slot they belong to moves every step.
"""
from __future__ import annotations

import os

import onnx
import torch

from ..export.onnx_export import io_names
from ..export.spec import ModelSpec
from ..runtime.kv_cache import KVCache
from .base import Engine
from .staging import StagedBucket

_ELEM = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
         torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
         torch.bool: onnx.TensorProto.BOOL}


class OrtCudaGraphEngine(Engine):
    name = "onnxruntime-cuda"

    def __init__(self, onnx_path: str | os.PathLike, spec: ModelSpec, kv_dtype: torch.dtype, device_id: int = 0):
        import onnxruntime as ort

        self.ort, self.spec, self.kv_dtype, self.device, self.device_id = ort, spec, kv_dtype, "cuda", device_id
        providers = [("CUDAExecutionProvider", {"device_id": device_id, "enable_cuda_graph": "1"})]
        self.session = ort.InferenceSession(str(onnx_path), providers=providers)
        self.in_names, self.out_names = io_names(spec.num_layers)
        self.buckets: dict[tuple, tuple[StagedBucket, object, object]] = {}

    def step(self, cache: KVCache, input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        t, total, r = input_ids.shape[0], attn_mask.shape[1], logit_rows.shape[0]
        cache.slots(t)
        key = (cache.buf.data_ptr(), t, total, r)
        if key not in self.buckets:
            self.buckets[key] = self._bucket(cache, t, total, r, graph_id=len(self.buckets) + 1)
        b, io, run_options = self.buckets[key]
        b.load(cache, input_ids, position_ids, attn_mask, logit_rows)
        torch.cuda.current_stream().synchronize()   # the input copies land before ORT's stream reads them
        self.session.run_with_iobinding(io, run_options)
        b.scatter_new_kv(cache)
        cache.advance(t)
        return b.logits

    def _bucket(self, cache: KVCache, t: int, total: int, r: int, graph_id: int):
        b = StagedBucket.make(self.spec, self.kv_dtype, cache.buf.device, t, total, r)
        io = self.session.io_binding()

        def bind(fn, name: str, x: torch.Tensor) -> None:
            fn(name, "cuda", self.device_id, _ELEM[x.dtype], tuple(x.shape), x.data_ptr())

        for name, x in b.inputs.items():
            bind(io.bind_input, name, x)
        for n, past in enumerate(cache.past(total - t)):
            bind(io.bind_input, self.in_names[4 + n], past)
            bind(io.bind_output, self.out_names[1 + n], b.new_kv[n])
        bind(io.bind_output, "logits", b.logits)
        run_options = self.ort.RunOptions()
        run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return b, io, run_options
