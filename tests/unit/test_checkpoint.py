"""Hugging Face folder loading: tiny random transformers models round-trip through load_decoder and
give the same logits as transformers; bad inputs give one SpecError naming the problem and the fix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import reference_logits
from trtspec.export.checkpoint import load_checkpoint, load_decoder
from trtspec.export.spec import SpecError

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.2, 1.5, 2.5], "long_factor": [1.5, 2.0, 4.0, 9.0]}
CASES = {
    # llama3 rope scaling exercises the config's rope_parameters; untied head.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # q/k/v bias, tied embeddings
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, eos_token_id=[2, 5],
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # head_dim (32) != hidden / heads (16); every layer over a sliding window of 6 keys (the prompt is 20)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, sliding_window=6,
                                                           tie_word_embeddings=False)),
    # per-head q/k RMSNorm before rotary, no biases, head_dim (32) from the config, tied embeddings
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # joined qkv_proj and gate_up_proj in the checkpoint, rotary over half of each head, longrope (its
    # short factors: the 72 positions of the greedy test stay within the original 80)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0, sliding_window=None,
                                                   original_max_position_embeddings=80, rope_parameters=LONGROPE)),
    # (1 + w) norms, scaled embeddings, GeGLU, q/k norms, four norms per layer, query_pre_attn_scalar;
    # layers 0 and 1 over a window of 5 keys with their own rotary base, layer 2 global with linear scaling
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=5, sliding_window_pattern=3,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # 2 of 6 experts per token, renormalized, in layers 1 and 2; layer 0 keeps a dense MLP
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False)),
}


def hf_model(arch: str, seed: int = 0):
    cfg_cls, model_cls, extra = CASES[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # random biases and norm weights (not zeros and ones): a dropped one is noticed
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.3)
            elif name.endswith("mlp.gate.weight"):      # the router: peaked (0.02 would route by noise)
                p.normal_(0, 1.0)
    return model



@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    out = {}
    for arch in CASES:
        folder = tmp_path_factory.mktemp(arch)
        model = hf_model(arch)
        # llama is saved in shards to exercise model.safetensors.index.json
        model.save_pretrained(folder, **({"max_shard_size": "40KB"} if arch == "llama" else {}))
        out[arch] = (folder, model)
    return out


@pytest.mark.parametrize("arch", list(CASES))
def test_hf_round_trip_matches_transformers(saved, arch):
    folder, model = saved[arch]
    if arch == "llama":
        assert (folder / "model.safetensors.index.json").is_file()
    dec = load_decoder(folder)
    assert dec.spec.arch == arch
    tokens = [3, 17, 42, 5, 96, 0, 61, 8, 23, 77, 12, 40, 9, 33, 1, 50, 70, 2, 90, 11]
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float()
    ours = reference_logits(dec, tokens)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_every_model_family_is_checked_against_transformers():
    from trtspec.export.families import FAMILIES
    assert set(CASES) == set(FAMILIES)


@pytest.mark.parametrize("arch", list(CASES))
def test_greedy_output_equals_transformers_over_64_tokens(saved, arch):
    """Decode, not only the prompt: our Generator's greedy tokens against transformers' generate."""
    from trtspec.engines.torch_engine import TorchEngine
    from trtspec.runtime.generator import Generator
    folder, model = saved[arch]
    prompt = [3, 17, 42, 5, 96, 0, 61, 8]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                             min_new_tokens=64, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    gen = Generator(TorchEngine(load_decoder(folder)), capacity=128)
    try:
        assert gen.generate(prompt, strategy="ar", max_new_tokens=64).token_ids == ref
    finally:
        gen.close()


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
     "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False}],
    ids=["yarn", "yarn-mscale"])
def test_yarn_rope_matches_transformers(tmp_path, rope):
    """YaRN's frequencies and attention factor, over a prompt past the original context."""
    torch.manual_seed(1)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**BASE, "max_position_embeddings": 64},
                                                                   head_dim=16, rope_parameters=rope)).eval()
    model.save_pretrained(tmp_path)
    dec = load_decoder(tmp_path)
    assert dec.spec.rope_scaling["rope_type"] == "yarn" and dec.rope_scale != 1.0
    tokens = [(7 * i + 3) % 97 for i in range(40)]
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float()
    assert (reference_logits(dec, tokens) - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_longrope_long_factors_match_transformers_past_the_original_context(tmp_path):
    """An engine whose context passes the original one uses longrope's long factors for every token
    (as llama.cpp chooses by its context); transformers uses them for a forward that long (a fresh
    model: transformers keeps the factors of the last forward it saw)."""
    from trtspec.export.model import Decoder, choose_rope_factors
    folder, model = tmp_path, hf_model("phi3")
    model.save_pretrained(folder)
    spec, state = load_checkpoint(folder)
    assert spec.rope_dim == 8 and spec.head_dim == 16 and "self_attn.qkv_proj" not in " ".join(state)
    choose_rope_factors(spec, 128)
    assert spec.rope_scaling["factors"] == "long"
    dec = Decoder.from_state(spec, state, torch.float32)
    tokens = [(7 * i + 3) % 97 for i in range(100)]
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float()
    assert (reference_logits(dec, tokens) - ref).abs().max() <= 1e-4 * ref.abs().max()
    short = load_decoder(folder)                      # within the original context: the short factors
    assert (reference_logits(short, tokens) - ref).abs().max() > 1e-3 * ref.abs().max()   # 10x the tolerance


def test_streamed_weights_split_joined_tensors_bit_for_bit(saved):
    """The streaming build's reader (engines/weights.py) gives Phi-3's q/k/v and gate/up as the rows
    of the checkpoint's joined tensors, equal to what the whole-model loader gives."""
    from trtspec.engines.weights import open_weights
    folder, _ = saved["phi3"]
    _, state = load_checkpoint(folder)
    weights = open_weights(folder)
    assert set(weights.shapes) == set(state)
    assert all(torch.equal(weights.get(k, torch.float32), state[k]) for k in state)


def test_dynamic_rope_is_refused_in_one_line(saved, tmp_path):
    folder = _edited(saved["llama"][0], tmp_path / "m",
                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(SpecError, match="rope scaling type 'dynamic' is not supported") as e:
        load_decoder(folder)
    assert "\n" not in str(e.value)


def test_bf16_load_converts_every_tensor(saved):
    spec, state = load_checkpoint(saved["qwen2"][0], dtype=torch.bfloat16)
    assert spec.attention_bias and spec.tie_word_embeddings
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert spec.extra["eos_token_ids"] == [2, 5]  # from config.json / generation_config.json


def _copy(folder: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    dest.mkdir()
    for f in folder.iterdir():
        if f.name not in skip:
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _edited(folder: Path, dest: Path, **config) -> Path:
    """A copy of `folder` whose config.json has `config`'s keys changed."""
    dest = _copy(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **config}))
    return dest


def test_missing_path(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_folder_without_config(saved, tmp_path):
    folder = _copy(saved["qwen2"][0], tmp_path / "m", skip=("config.json",))
    with pytest.raises(SpecError, match="no config.json"):
        load_checkpoint(folder)


def test_folder_without_safetensors(saved, tmp_path):
    folder = _copy(saved["qwen2"][0], tmp_path / "m", skip=("model.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SpecError, match=r"no \*\.safetensors.*pytorch_model\.bin.*safe_serialization"):
        load_checkpoint(folder)


def test_missing_shard(saved, tmp_path):
    index = json.loads((saved["llama"][0] / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    folder = _copy(saved["llama"][0], tmp_path / "m", skip=(shard,))
    with pytest.raises(SpecError, match="missing.*complete checkpoint"):
        load_checkpoint(folder)


def test_unsupported_architecture(saved, tmp_path):
    folder = _edited(saved["qwen2"][0], tmp_path / "m", model_type="gpt2")
    with pytest.raises(SpecError, match="unsupported architecture 'gpt2'"):
        load_checkpoint(folder)


def test_shape_mismatch(saved, tmp_path):
    folder = _edited(saved["qwen2"][0], tmp_path / "m", intermediate_size=128)
    with pytest.raises(SpecError, match=r"has shape .* config implies .*use the config that came with them"):
        load_checkpoint(folder)


def test_missing_weights(saved, tmp_path):
    folder = _edited(saved["qwen2"][0], tmp_path / "m", num_hidden_layers=3)
    with pytest.raises(SpecError, match=r"missing \['model.layers.2"):
        load_checkpoint(folder)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(SpecError, match="not a GGUF file"):
        load_checkpoint(f)


def test_a_multimodal_gemma3_folder_loads_its_language_model(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration (config `gemma3` with a sparse
    `text_config`, weights under `language_model.*` beside a vision tower): the decoder is read from
    them and gives transformers' text-only logits; the vision tower is left unread."""
    torch.manual_seed(2)
    text = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=5, sliding_window_pattern=2,
                query_pre_attn_scalar=24, max_position_embeddings=128,
                rope_scaling={"rope_type": "linear", "factor": 4.0})
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=90, boi_token_index=91, eoi_token_index=92)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["text_config"] = {k: saved["text_config"][k] for k in ("model_type", "hidden_size", "intermediate_size",
                            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                            "sliding_window", "query_pre_attn_scalar", "max_position_embeddings", "vocab_size",
                            "layer_types", "rope_parameters")}          # sparse, as the Hub's configs are
    (tmp_path / "config.json").write_text(json.dumps(saved))
    dec = load_decoder(tmp_path)
    assert dec.spec.arch == "gemma3" and dec.spec.rope_scaling["factor"] == 4.0 and dec.spec.tie_word_embeddings
    tokens = [3, 17, 42, 5, 86, 0, 61, 8, 23, 77, 12, 40, 9, 33, 1, 50]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0].float()
    ours = reference_logits(dec, tokens)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    from trtspec.engines.weights import SafetensorsWeights
    streamed = SafetensorsWeights(tmp_path)
    assert set(streamed.shapes) == set(dec.state_dict()) - {"lm_head.weight"}
    assert torch.equal(streamed.get("model.layers.1.self_attn.k_norm.weight", torch.float32),
                       model.model.language_model.layers[1].self_attn.k_norm.weight)
