"""TensorRT plan building: a thin adapter over the exported ONNX (TensorRT 10/11 Python API).

NOT EXERCISED IN CI: TensorRT cannot be installed where trtspec is developed. Written against the
documented API (Builder, OnnxParser, optimization profiles, build_serialized_network) and imported
lazily. Precision comes from the ONNX tensor types (TensorRT 11 networks are always strongly typed),
so an fp16 plan is built from the fp16 ONNX file. Two profiles, as Edge-LLM does: prefill chunks
and decode/verify steps (small T, any cache length).
"""
from __future__ import annotations

from pathlib import Path

from ..export.contract import io_names
from ..export.spec import ModelSpec


def tensorrt_unavailable_reason() -> str | None:
    """None when plans can be built here, else one line saying why not."""
    try:
        import tensorrt  # noqa: F401
    except Exception as e:  # ImportError, or the PyPI stub failing to fetch its libraries
        return f"TensorRT is not installed ({type(e).__name__}); install trtspec[tensorrt] on a CUDA machine"
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible"
    except Exception:
        return "torch cannot query CUDA"
    return None


def build_plan(onnx_path: Path, plan_path: Path, spec: ModelSpec, max_seq_len: int,
               prefill_chunk: int, max_step_tokens: int, max_batch: int = 8) -> Path:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()

    def profile(t_min: int, t_opt: int, t_max: int, b_max: int):
        p = builder.create_optimization_profile()
        c_max = max_seq_len - t_min
        b_opt = max(1, b_max // 2)
        p.set_shape("input_ids", (1, t_min), (b_opt, t_opt), (b_max, t_max))
        p.set_shape("position_ids", (1, t_min), (b_opt, t_opt), (b_max, t_max))
        p.set_shape("attn_mask", (1, t_min, t_min), (b_opt, t_opt, t_opt + max_seq_len // 2),
                    (b_max, t_max, max_seq_len))
        p.set_shape("logit_rows", (1, 1), (b_opt, t_opt), (b_max, t_max))
        d = spec.head_dim
        for name in io_names(spec.num_layers, spec.num_kv_heads)[0][4:]:
            p.set_shape(name, (1, 0, d), (b_opt, max_seq_len // 2, d), (b_max, c_max, d))
        return p

    config.add_optimization_profile(profile(1, min(prefill_chunk, 128), prefill_chunk, 1))   # 0: prefill
    config.add_optimization_profile(profile(1, 8, max_step_tokens, max_batch))               # 1: decode/verify
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RuntimeError(f"TensorRT failed to build a plan from {onnx_path} (see the log above)")
    plan_path.write_bytes(bytes(blob))
    return plan_path
