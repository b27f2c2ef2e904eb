"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in each layer's MLP the top
`num_experts_per_tok` of `num_experts` experts a router picks per token, weighted by its softmax
probabilities (renormalized over the chosen ones where `norm_topk_prob`). A token's experts depend on
its own row only (model.py `MoE`: each row gathers its experts' weights), so a tree row routes
as the same token does alone. GGUF `qwen3moe`: the experts stacked as llama.cpp stores them (it
always renormalizes the chosen experts' weights)."""
from .base import Family, hf_window


def _extra(spec) -> dict:
    return {"attention_bias": spec.attention_bias, **hf_window(spec, per_layer=True),
            "num_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token,
            "moe_intermediate_size": spec.moe_intermediate_size, "norm_topk_prob": spec.norm_topk_prob,
            "decoder_sparse_step": spec.decoder_sparse_step, "mlp_only_layers": list(spec.mlp_only_layers)}


FAMILY = Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeConfig", "Qwen3MoeForCausalLM", gguf="qwen3moe", qk_norm=True,
                experts=True, hf_extra=_extra,
                gguf_names=(("ffn_gate_inp", "mlp.gate"), ("ffn_gate_exps", "mlp.experts.gate_proj"),
                            ("ffn_up_exps", "mlp.experts.up_proj"), ("ffn_down_exps", "mlp.experts.down_proj")))
