"""TrtEngine: the step contract run by a TensorRT plan (TensorRT 10/11 Python API), CUDA only.

NOT EXERCISED IN CI, NOR ANYWHERE YET: TensorRT cannot be installed where trtspec is developed, and
no GPU was available. Written against the documented API (Runtime.deserialize_cuda_engine,
IExecutionContext.set_input_shape / set_tensor_address / execute_async_v3), imported lazily.

It is a thin adapter over the shared machinery: the same KV pool, the same bucketed shapes from
ModelRunner, the same StagedBucket as the other graph engines. For one CUDA graph per bucket
(B, T, C+T, R) every bound address must be fixed, so inputs and each row's past are copied into
per-bucket static buffers, and the new keys/values come out of one and are copied into the rows'
slots (device copies outside the graph); logits come out of a per-bucket buffer.
A bucket's first step runs `execute_async_v3` once (TensorRT may do shape work on the host), then
the second is captured on the engine's stream and replayed afterwards (Edge-LLM does the same).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..export.contract import io_names
from ..export.spec import ModelSpec
from ..runtime.engine import Engine
from ..runtime.kv_cache import KVCache
from .staging import StagedBucket, after_inputs

PREFILL_PROFILE, STEP_PROFILE = 0, 1        # as built by tensorrt_build.build_plan


class TrtEngine(Engine):
    name = "tensorrt"
    logits_in_own_buffer = True

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
        kv = self.engine.get_tensor_dtype("past_key.0.0")
        self.kv_dtype = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                         trt.DataType.BF16: torch.bfloat16}[kv]
        self.cuda_graphs, self.max_step_tokens = cuda_graphs, max_step_tokens
        # Rows per step the decode/verify profile was built for; the Batcher caps its batches here.
        self.max_batch = int(self.engine.get_tensor_profile_shape("input_ids", STEP_PROFILE)[2][0])
        self.buckets: dict[tuple, StagedBucket] = {}

    def close(self) -> None:
        self.buckets.clear()                         # graphs, then contexts, then the engine
        self.contexts.clear()
        self.engine = None

    def step_batch(self, caches: list[KVCache], input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        (b, t), total, r = input_ids.shape, attn_mask.shape[2], logit_rows.shape[1]
        self.check_room(caches, t)
        key = (b, t, total, r)
        g = self.buckets.get(key)
        if g is None:
            g = self.buckets[key] = StagedBucket.make(self.spec, self.kv_dtype, "cuda", b, t, total, r)
        g.load(caches, input_ids, position_ids, attn_mask, logit_rows)
        after_inputs(self.stream)                                # enqueue after the copies above
        with torch.cuda.stream(self.stream):
            if g.graph is not None:
                g.graph.replay()
            else:
                ctx = self.contexts[PREFILL_PROFILE if b == 1 and t > self.max_step_tokens else STEP_PROFILE]
                self._bind(ctx, g)                               # buckets share a profile's context
                if not ctx.execute_async_v3(self.stream.cuda_stream):
                    raise RuntimeError(f"TensorRT execute_async_v3 failed for step shape B={b}, T={t}, C+T={total}")
                g.runs += 1
                if self.cuda_graphs and g.runs == 1:             # warm-up done: capture the next one
                    g.graph = self._capture(ctx)
        torch.cuda.current_stream().wait_stream(self.stream)
        g.scatter_new_kv(caches)
        return g.logits

    def _bind(self, ctx, g: StagedBucket) -> None:
        def shape(name: str, x: torch.Tensor) -> None:
            if not ctx.set_input_shape(name, tuple(x.shape)):
                raise RuntimeError(f"TensorRT plan has no profile for {name} of shape {tuple(x.shape)}; "
                                   "rebuild with a larger max_seq_len / slots, or use smaller buckets")

        for name, x in g.inputs.items():
            shape(name, x)
            ctx.set_tensor_address(name, x.data_ptr())
        ins, outs = io_names(self.spec.num_layers, self.spec.num_kv_heads)
        for k, (past, new) in enumerate(zip(ins[4:], outs[1:])):     # one per layer, key/value, KV head
            shape(past, g.past[k])
            ctx.set_tensor_address(past, g.past[k].data_ptr())
            ctx.set_tensor_address(new, g.new_kv[k].data_ptr())
        ctx.set_tensor_address("logits", g.logits.data_ptr())

    def _capture(self, ctx):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                ctx.execute_async_v3(self.stream.cuda_stream)
            return graph
        except RuntimeError:
            return None                                          # stay on plain enqueues for this bucket
