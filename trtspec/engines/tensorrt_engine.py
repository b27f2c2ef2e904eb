"""TrtEngine: the step contract run by a TensorRT plan (TensorRT 10/11 Python API), CUDA only.

NOT EXERCISED IN CI, NOR ANYWHERE YET: TensorRT cannot be installed where trtspec is developed, and
no GPU was available. Written against the documented API (Runtime.deserialize_cuda_engine,
IExecutionContext.set_input_shape / set_tensor_address / execute_async_v3), imported lazily.

It is a thin adapter over the shared machinery: the same KVCache buffer, the same bucketed shapes
from ModelRunner. For one CUDA graph per bucket every bound address must be fixed, so:
  * the past binds `buf[l, j, :C]` (fixed base address; C fixed per cache-length bucket),
  * the new keys/values go to staging buffers owned per bucket, then `index_copy_` into the cache
    slots (a small device copy, the only part outside the graph),
  * inputs are copied into per-bucket static buffers; logits come out of a per-bucket buffer.
A bucket's first step runs `execute_async_v3` once (TensorRT may do shape work on the host), then
the second is captured on the engine's stream and replayed afterwards (Edge-LLM does the same).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..export.spec import ModelSpec
from ..runtime.kv_cache import KVCache
from .base import Engine
from .staging import StagedBucket

PREFILL_PROFILE, STEP_PROFILE = 0, 1        # as built by tensorrt_build.build_plan


class TrtEngine(Engine):
    name = "tensorrt"

    def __init__(self, plan_path: str | Path, spec: ModelSpec, cuda_graphs: bool = True, max_step_tokens: int = 128):
        import tensorrt as trt

        self.trt, self.spec, self.device = trt, spec, "cuda"
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load {plan_path} (built for another TensorRT or GPU?)")
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for profile in range(self.engine.num_optimization_profiles):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
            self.contexts.append(ctx)
        kv = self.engine.get_tensor_dtype("past_key.0")
        self.kv_dtype = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                         trt.DataType.BF16: torch.bfloat16}[kv]
        self.cuda_graphs, self.max_step_tokens = cuda_graphs, max_step_tokens
        self.buckets: dict[tuple, StagedBucket] = {}

    def step(self, cache: KVCache, input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        t, total, r = input_ids.shape[0], attn_mask.shape[1], logit_rows.shape[0]
        cache.slots(t)                                           # capacity check
        key = (cache.buf.data_ptr(), t, total, r)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = StagedBucket.make(self.spec, self.kv_dtype, cache.buf.device, t, total, r)
        b.load(cache, input_ids, position_ids, attn_mask, logit_rows)
        with torch.cuda.stream(self.stream):
            if b.graph is not None:
                b.graph.replay()
            else:
                ctx = self.contexts[PREFILL_PROFILE if t > self.max_step_tokens else STEP_PROFILE]
                self._bind(ctx, b, cache, t, total)              # buckets share a profile's context
                if not ctx.execute_async_v3(self.stream.cuda_stream):
                    raise RuntimeError(f"TensorRT execute_async_v3 failed for step shape T={t}, C+T={total}")
                b.runs += 1
                if self.cuda_graphs and b.runs == 1:             # warm-up done: capture the next one
                    b.graph = self._capture(ctx)
            b.scatter_new_kv(cache)
        torch.cuda.current_stream().wait_stream(self.stream)
        cache.advance(t)
        return b.logits

    def _bind(self, ctx, b: StagedBucket, cache: KVCache, t: int, total: int) -> None:
        for name, x in b.inputs.items():
            ctx.set_input_shape(name, tuple(x.shape))
            ctx.set_tensor_address(name, x.data_ptr())
        for n, past in enumerate(cache.past(total - t)):
            kind, layer = ("key", "value")[n % 2], n // 2
            ctx.set_input_shape(f"past_{kind}.{layer}", tuple(past.shape))
            ctx.set_tensor_address(f"past_{kind}.{layer}", past.data_ptr())
            ctx.set_tensor_address(f"new_{kind}.{layer}", b.new_kv[n].data_ptr())
        ctx.set_tensor_address("logits", b.logits.data_ptr())

    def _capture(self, ctx):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                ctx.execute_async_v3(self.stream.cuda_stream)
            return graph
        except RuntimeError:
            return None                                          # stay on plain enqueues for this bucket
