"""Sliding windows (Gemma 3, Mistral, Phi-3): what config.json says becomes the spec transformers
reads from it, and a windowed layer sees the last `window` keys of each row's own history wherever
its rows lie (model.py `window_mask`)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trtspec.export.model import window_mask
from trtspec.export.spec import ModelSpec, SpecError

transformers = pytest.importorskip("transformers")

# Gemma 3 1B's config.json as the Hub has it (transformers 4.50's format: the window pattern, the
# local rotary base beside rope_theta); Gemma 3 4B's text part adds linear scaling to the global layers.
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
             "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}


@pytest.mark.parametrize("scaling", [None, {"factor": 8.0, "rope_type": "linear"}], ids=["1b", "4b-text"])
def test_a_hub_gemma3_config_reads_as_transformers_reads_it(scaling):
    cfg = {**GEMMA3_1B, "rope_scaling": scaling}
    spec = ModelSpec.from_hf_config(cfg)
    theirs = transformers.Gemma3TextConfig(**cfg)
    assert spec.arch == "gemma3" and spec.layer_types == theirs.layer_types
    assert spec.layer_types.count("full_attention") == 4 and spec.layer_types[5] == "full_attention"
    assert spec.sliding_window == theirs.sliding_window == 512
    assert spec.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 10000
    assert spec.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert (spec.rope_scaling or {}).get("factor") == theirs.rope_parameters["full_attention"].get("factor")
    assert spec.query_pre_attn_scalar == 256 and spec.hidden_act == "gelu_pytorch_tanh" and spec.tie_word_embeddings
    # and what transformers writes (rope_parameters per layer type, layer_types) reads back the same
    again = ModelSpec.from_hf_config({**theirs.to_dict(), "model_type": "gemma3_text"})
    assert (again.layer_types, again.local_rope_theta, again.rope_theta, again.sliding_window) == \
        (spec.layer_types, spec.local_rope_theta, spec.rope_theta, spec.sliding_window)


@pytest.mark.parametrize("bad,says", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping (30.0) is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping (50.0) is not supported"),
    ({"use_bidirectional_attention": True}, "embedding model"),
    ({"hidden_activation": "relu"}, "activation 'relu' is not supported (supported: silu, gelu_pytorch_tanh)"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types must name 26 layers"),
])
def test_what_trtspec_cannot_run_is_refused_in_one_line(bad, says):
    with pytest.raises(SpecError, match=None) as e:
        ModelSpec.from_hf_config({**GEMMA3_1B, **bad})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_qwen2_window_covers_the_layers_from_max_window_layers_on():
    cfg = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                   max_window_layers=2).to_dict()
    spec = ModelSpec.from_hf_config({**cfg, "layer_types": None})
    assert [spec.windowed(i) for i in range(4)] == [False, False, True, True]
    assert ModelSpec.from_hf_config(cfg).layer_types == cfg["layer_types"]
    off = ModelSpec.from_hf_config(transformers.Qwen2Config(num_hidden_layers=4).to_dict())
    assert off.sliding_window is None and not any(off.windowed(i) for i in range(4))


def test_the_window_is_the_last_keys_of_each_rows_own_history():
    """Random trees laid out as the runtime lays them (committed rows, scratch rows fed in earlier
    forwards, the step's rows in topological order), deeper than the window: a row keeps exactly the
    last `window` keys of its history (transformers: key position > query position - window). A mask
    from physical row indices would keep other keys (checked: the layouts do put them elsewhere)."""
    rng = np.random.default_rng(0)
    moved = 0
    for _ in range(200):
        committed, n, window = int(rng.integers(0, 12)), int(rng.integers(1, 20)), int(rng.integers(1, 10))
        parents = [int(rng.integers(-1, k)) for k in range(n)]       # node k's parent: an earlier node or the prefix
        history = []
        for k in range(n):
            path, p = [committed + k], parents[k]
            while p >= 0:
                path.append(committed + p)
                p = parents[p]
            history.append(list(range(committed)) + path[::-1])
        mask = torch.zeros(1, n, committed + n, dtype=torch.bool)
        for k, h in enumerate(history):
            mask[0, k, h] = True
        got = window_mask(mask, window)[0]
        for k, h in enumerate(history):
            assert torch.nonzero(got[k]).flatten().tolist() == h[-window:]
            position = len(h) - 1                          # the row's logical position
            by_index = [j for j in h if j > position - window]
            moved += by_index != h[-window:]
    assert moved > 0
