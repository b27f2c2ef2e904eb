"""GGUF loading: tiny files written with gguf.GGUFWriter (exact weights, every quantization we meet in
practice, llama.cpp's q/k permutation undone, truncation), and the real SmolLM2-135M pack compared
with transformers' own GGUF loader."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from conftest import reference_logits
from trtspec.export.checkpoint import load_checkpoint, load_decoder
from trtspec.export.gguf_loader import GGUFFile, load_gguf, spec_from_gguf
from trtspec.export.spec import SpecError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm"}


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim from llama.cpp convert_hf_to_gguf.py (LlamaModel.permute), applied to q and k."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, *mod, kind = hf.split(".")
        return f"blk.{i}.{HF_TO_GGUF['.'.join(mod)]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_gguf(path, arch: str, cfg, tensors: dict[str, np.ndarray], raw: dict[str, Q] | None = None,
               name: str = "tiny", more=None) -> None:
    """A GGUF with llama.cpp's metadata keys; `raw` names tensors given as already-quantized bytes;
    `more(writer)` adds a family's own keys."""
    w = gguf.GGUFWriter(str(path), arch)
    if more:
        more(w)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_array("general.languages", ["en", "fr"])
    for k, a in tensors.items():
        w.add_tensor(k, a, raw_dtype=(raw or {}).get(k))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_hf(arch: str, **kw):
    cfg_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
    cfg = getattr(transformers, cfg_cls)(**{
        **dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), **kw})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:  # non-trivial biases and norms
                p.normal_(1.0 if "norm" in n else 0.0, 0.3)
    return cfg, model



TOKENS = [3, 17, 42, 5, 96, 0, 61, 8, 23, 77, 12, 40, 9, 33, 1, 50]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_gives_back_hf_weights_and_logits(tmp_path, arch):
    """Weights written the way llama.cpp's converter writes them (q/k permuted for llama only; qwen3's
    per-head q/k norms as attn_q_norm / attn_k_norm) load back bit-exact under HF names, and the
    Decoder reproduces transformers' logits."""
    tie = arch != "llama"
    cfg, model = tiny_hf(arch, tie_word_embeddings=tie, **({"head_dim": 16} if arch == "qwen3" else {}))
    hf_state = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    tensors = {}
    for k, v in hf_state.items():
        a = v.numpy()
        if arch == "llama" and ".q_proj." in k:
            a = llama_cpp_permute(a, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in k:
            a = llama_cpp_permute(a, cfg.num_attention_heads, cfg.num_key_value_heads)
        tensors[gguf_name(k)] = a
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, cfg, tensors)
    if arch == "llama":  # the file really is permuted, so the round trip below proves the un-permute
        q = hf_state["model.layers.0.self_attn.q_proj.weight"].numpy()
        assert not np.array_equal(tensors["blk.0.attn_q.weight"], q)

    spec, state = load_checkpoint(path)
    assert (spec.arch, spec.attention_bias, spec.tie_word_embeddings) == (arch, arch == "qwen2", tie)
    assert (spec.vocab_size, spec.head_dim, spec.num_kv_heads, spec.extra["eos_token_ids"]) == (97, 16, 2, [2])
    assert state.keys() == hf_state.keys()
    for k, v in hf_state.items():
        assert torch.equal(state[k], v), k
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0]
    ours = reference_logits(load_decoder(path), TOKENS)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_f32_gguf_of_gemma3_and_qwen3moe_gives_back_hf_weights_and_logits(tmp_path):
    """The two families whose GGUF names differ from llama's, written as llama.cpp's converter writes
    them (tests/e2e/test_llama_cpp_families.py runs the converter itself where its tree is built):
    Gemma 3's four norms per layer stored as 1 + w, its window and local rotary base as metadata;
    Qwen3-MoE's router and stacked experts. Loaded back under our names, bit for bit, with
    transformers' logits."""
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",   # Gemma's
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
    torch.manual_seed(0)
    cases = {
        "gemma3": (transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **base, num_hidden_layers=6, sliding_window=5, query_pre_attn_scalar=16)), lambda w: (
            w.add_sliding_window(5), w.add_rope_freq_base_swa(10000.0), w.add_key_length(16), w.add_value_length(16))),
        "qwen3moe": (transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **base, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, tie_word_embeddings=False)), lambda w: (
            w.add_expert_count(6), w.add_expert_used_count(2), w.add_expert_feed_forward_length(32), w.add_key_length(16))),
    }
    for arch, (model, more) in cases.items():
        model.eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.5, 0.3)
        ours, tensors = {}, {}                       # our names -> values; GGUF names -> what the file holds
        for k, v in model.state_dict().items():
            if k == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if k.endswith("experts.gate_up_proj"):   # transformers 5 holds gate and up stacked as one
                layer = k.split(".")[2]
                for part, half in zip(("gate", "up"), v.chunk(2, 1)):
                    ours[k.replace("gate_up_proj", f"{part}_proj")] = half
                    tensors[f"blk.{layer}.ffn_{part}_exps.weight"] = half.contiguous().numpy()
                continue
            if k.endswith("experts.down_proj"):
                ours[k], tensors[f"blk.{k.split('.')[2]}.ffn_down_exps.weight"] = v, v.numpy()
                continue
            stored = 1.0 + v if arch == "gemma3" and k.endswith("norm.weight") else v
            ours[k] = stored
            m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", k)
            own = m and (arch == "gemma3" or m.group(2) == "mlp.gate")      # else llama's names
            tensors[f"blk.{m.group(1)}.{names[m.group(2)]}.weight" if own else gguf_name(k)] = stored.numpy()
        cfg = model.config
        cfg.rope_parameters = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
        path = tmp_path / f"{arch}.gguf"
        write_gguf(path, arch, cfg, tensors, more=more)
        spec, state = load_checkpoint(path)
        assert state.keys() == ours.keys()
        assert all(torch.equal(state[k], ours[k]) for k in ours), [k for k in ours if not torch.equal(state[k], ours[k])]
        if arch == "gemma3":
            assert spec.norm_weights_shifted and spec.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
            assert (spec.sliding_window, spec.local_rope_theta, spec.query_pre_attn_scalar) == (5, 10000.0, 16)
        else:
            assert (spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size, spec.norm_topk_prob) == \
                (6, 2, 32, True)
        with torch.no_grad():
            ref = model(torch.tensor([TOKENS])).logits[0]
        got = reference_logits(load_decoder(path), TOKENS)
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), arch


def _k_quant_bytes(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Random but well-formed K-quant blocks (gguf cannot quantize K types): random bits with finite
    fp16 scales written where the block layout keeps them."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, size=(rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        b[..., 0:4] = scale.reshape(rows, cols // block, 4)  # d, dmin lead the block
    else:  # Q6_K: d trails the block
        b[..., -2:] = scale[..., :2].reshape(rows, cols // block, 2)
    return b.reshape(rows, -1)


def test_quantized_tensors_match_gguf_dequantize(tmp_path):
    """Every tensor type we meet in real files loads as gguf.quants.dequantize gives it (qwen2: no permute)."""
    cfg, model = tiny_hf("qwen2", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    plan = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.F16,
            "blk.0.attn_v.weight": Q.Q4_K, "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_q.weight": Q.Q4_0,
            "blk.1.ffn_up.weight": Q.Q5_0, "blk.1.attn_k.weight": Q.BF16}
    tensors, raw = {}, {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        name, a = gguf_name(k), v.numpy()
        qtype = plan.get(name, Q.F32)
        if qtype in (Q.Q4_K, Q.Q6_K):
            a = _k_quant_bytes(qtype, *a.shape, rng)
        elif qtype == Q.F16:
            a = a.astype(np.float16)
        elif qtype != Q.F32:
            a = gguf.quants.quantize(a, qtype)
        if a.dtype == np.uint8:
            raw[name] = qtype
        tensors[name] = a
    path = tmp_path / "q.gguf"
    write_gguf(path, "qwen2", cfg, tensors, raw)

    gf = GGUFFile(path)
    assert {t.name: t.qtype for t in gf.tensors if t.name in plan} == plan
    spec, state = load_gguf(path)
    assert spec.hidden_size == 256 and spec.tie_word_embeddings
    for t in gf.tensors:
        expected = gguf.quants.dequantize(tensors[t.name], t.qtype) if t.qtype != Q.F32 else tensors[t.name]
        hf = next(k for k in state if gguf_name(k) == t.name)
        assert torch.equal(state[hf], torch.from_numpy(np.asarray(expected, dtype=np.float32))), t.name
    _, bf16 = load_gguf(path, torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())


def test_header_parser_agrees_with_gguf_reader(tmp_path):
    cfg, model = tiny_hf("llama")
    tensors = {gguf_name(k): v.numpy() for k, v in model.state_dict().items()}
    tensors["blk.0.ffn_up.weight"] = gguf.quants.quantize(tensors["blk.0.ffn_up.weight"], Q.Q8_0)
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, tensors, {"blk.0.ffn_up.weight": Q.Q8_0})
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.metadata[key] == (len(value) if key == "tokenizer.ggml.tokens" else value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.qtype == b.tensor_type and a.offset == b.data_offset
        assert np.array_equal(ours.raw(a), b.data), a.name


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    cfg, model = tiny_hf("llama")
    path = tmp_path_factory.mktemp("g") / "tiny.gguf"
    write_gguf(path, "llama", cfg, {gguf_name(k): v.numpy() for k, v in model.state_dict().items()})
    return path


@pytest.mark.parametrize("fraction", [0.6, 0.02])  # cut in the tensor data / in the header
def test_truncated_file_is_one_clear_error(tiny_llama_gguf, tmp_path, fraction):
    data = tiny_llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(SpecError, match=r"GGUF file .*cut\.gguf is truncated or corrupt: .*re-download"):
        load_checkpoint(cut)


def test_unsupported_gguf_architecture(tmp_path):
    cfg, model = tiny_hf("llama")
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", cfg, {"token_embd.weight": model.state_dict()["model.embed_tokens.weight"].numpy()})
    with pytest.raises(SpecError, match="unsupported GGUF architecture 'gpt2'.*reads llama, qwen2, qwen3, phi3, gemma3, qwen3moe GGUF "
                                        "files; pick a model of one of those families"):
        load_checkpoint(path)


# ---- the real SmolLM2-135M pack -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from trtspec.export.packs import resolve_model

    try:
        return resolve_model("pack:smollm2-135m")
    except SpecError as e:
        pytest.skip(f"SmolLM2 pack not installed: {e}")


def transformers_gguf_model(path):
    """transformers' own GGUF loading (config parsing, dequantization, llama reverse-permute).

    `from_pretrained(gguf_file=...)` insists on `accelerate`; this is the same code path without it."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert missing == ["lm_head.weight"] and model.lm_head.weight is model.model.embed_tokens.weight  # tied
    return model.eval(), tensors


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, monkeypatch):
    # transformers parses the file twice (config, then tensors) with GGUFReader, ~5 s each for the
    # 49k-token vocabulary; hand it the same read-only reader the second time.
    readers = {}
    reader_cls = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, *a: readers.setdefault(str(p), reader_cls(p, *a)))
    ref_model, ref_tensors = transformers_gguf_model(smollm2)
    assert len(readers) == 1
    spec, state = load_checkpoint(smollm2)
    assert spec.arch == "llama" and spec.tie_word_embeddings and spec.vocab_size == 49152
    assert state.keys() == ref_tensors.keys()
    assert all(torch.equal(state[k], ref_tensors[k]) for k in state)  # same dequantization, same un-permute
    from trtspec.export.model import Decoder

    tokens = [1, 19556, 905, 216, 2, 753, 275, 24, 104, 727, 3805, 1003]
    ours = reference_logits(Decoder.from_state(spec, state, torch.float32), tokens)
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.slow
def test_smollm2_tokenizer_from_gguf_and_cache(smollm2, tmp_path, monkeypatch):
    from trtspec.export.tokenizer import eos_token_ids, load_tokenizer

    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    fresh = load_tokenizer(smollm2)  # converted by transformers from the GGUF metadata, then cached
    assert list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    cached = load_tokenizer(smollm2)  # from the cache: no GGUF parsing
    text = "Hello world! <|im_start|>user\ndef f(x):\n    return x ** 2  # ünïcödé 日本語<|im_end|>"
    ids = fresh.encode(text)
    assert cached.encode(text) == ids and cached.decode(ids) == fresh.decode(ids) == text
    assert cached.get_vocab() == fresh.get_vocab()
    assert eos_token_ids(cached, spec_from_gguf(GGUFFile(smollm2))) == {0, 2}  # <|endoftext|>, <|im_end|>


@pytest.mark.slow
def test_smollm2_truncated(smollm2, tmp_path):
    cut = tmp_path / "SmolLM2-cut.gguf"
    with open(smollm2, "rb") as f:
        cut.write_bytes(f.read(int(smollm2.stat().st_size * 0.6)))
    with pytest.raises(SpecError, match="truncated or corrupt"):
        load_checkpoint(cut)
