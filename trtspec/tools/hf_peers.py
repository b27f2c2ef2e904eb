"""Hugging Face transformers peers for `trtspec bench`, on the very same weights.

The transformers model is built from an engine folder's `weights.safetensors` and ModelSpec (our
weight names are HF names; a tied lm_head is absent from the file and re-tied here), in the same
dtype as our engine, in the same process (so the same torch thread count). Three peers:

    hf           greedy / sampled `generate` with the KV cache
    hf-assisted  assisted generation, `assistant_model` = our draft (transformers' own defaults for
                 the assistant: 20 tokens, constant schedule, confidence threshold 0.4)
    hf-lookup    prompt lookup decoding (`prompt_lookup_num_tokens`, default 10)

EOS is disabled (eos_token_id None in the model config and generation config) and min_new_tokens =
max_new_tokens, so every peer produces exactly max_new_tokens tokens, as our runtime does in the
benchmark with its stop ids cleared. Forward hooks time every target / assistant forward, so peers
get the same draft / verify / prefill / other split as our strategies (the first forward of each
model processes the prompt and is counted as prefill).
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from ..errors import RequestError
from ..export.spec import DTYPES, ModelSpec, SpecError

PEERS = ("hf", "hf-assisted", "hf-lookup")


def rope_parameters(spec: ModelSpec) -> dict:
    """transformers >= 5 `rope_parameters` for a spec (scaling dicts may use `type` or `rope_type`);
    per layer type where windowed layers have their own rotary (Gemma 3)."""
    rs = dict(spec.rope_scaling or {})
    rs.pop("factors", None)                        # trtspec's own: which longrope factors the engine uses
    kind = rs.pop("type", None)
    rs.setdefault("rope_type", kind or "default")
    rs = {**rs, "rope_theta": float(spec.rope_theta)}
    if spec.local_rope_theta:
        return {"full_attention": rs, "sliding_attention": {"rope_type": "default", "rope_theta": spec.local_rope_theta}}
    return rs


def hf_config(spec: ModelSpec, dtype: torch.dtype = torch.float32):
    """The transformers config (the family's `hf_config` class) equivalent to our ModelSpec."""
    import transformers

    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps,
        rope_parameters=rope_parameters(spec), tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings, hidden_act=spec.hidden_act, use_cache=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, dtype=dtype)
    extra = spec.family.hf_extra(spec)
    if isinstance(extra, str):                     # the spec has no transformers equivalent: why
        raise SpecError(extra)
    return getattr(transformers, spec.family.hf_config)(**{**common, **extra})


def joined_state(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names: tensors the family joins (Phi-3's qkv_proj,
    gate_up_proj) joined again by rows, as the loaders split them (families/base.py `unjoined`), and
    an MoE's stacked experts' gate and up as transformers 5 holds them (`experts.gate_up_proj`), a
    Gemma GGUF's norms as w (its file holds 1 + w: the peer then computes 1 + (a - 1), equal to the
    file's a for every a >= 0.5)."""
    out = dict(state)
    for joined, parts in spec.family.joined:
        for i in range(spec.num_layers):
            at = f"model.layers.{i}."
            out[f"{at}{joined}.weight"] = torch.cat([out.pop(f"{at}{part}.weight") for part in parts])
    if spec.norm_weights_shifted:                 # a Gemma GGUF's norms hold 1 + w; transformers adds the 1
        out = {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in out.items()}
    for i in range(spec.num_layers):              # transformers 5 holds an MoE's gate and up stacked as one
        at = f"model.layers.{i}.mlp.experts."
        if f"{at}gate_proj" in out:
            out[f"{at}gate_up_proj"] = torch.cat([out.pop(f"{at}gate_proj"), out.pop(f"{at}up_proj")], 1)
    return out


@torch.no_grad()
def hf_model_from_state(spec: ModelSpec, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """A transformers causal LM holding exactly these weights (HF names), cast to `dtype`."""
    import transformers

    cfg = hf_config(spec, dtype)
    cls = getattr(transformers, spec.family.hf_model)
    state = {k: v.to(dtype) for k, v in joined_state(spec, state).items() if not k.endswith("rotary_emb.inv_freq")}
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):        # no random init, no second copy of a large model
        model = cls(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (spec.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise SpecError(f"weights do not match transformers' {cls.__name__}: missing {missing[:4]}, "
                        f"unexpected {unexpected[:4]}")
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (RoPE inverse frequencies) stayed on the meta device: rebuild them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    embed = model.model.embed_tokens
    if hasattr(embed, "scalar_embed_scale"):           # Gemma's scaled embeddings keep their scale so
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if still_meta:
        raise SpecError(f"transformers model has uninitialized tensors after loading: {still_meta[:4]}")
    model.generation_config = transformers.GenerationConfig(bos_token_id=None, eos_token_id=None,
                                                            pad_token_id=None)
    return model.eval().requires_grad_(False)


def hf_model_from_engine(folder: str | Path, role: str = "target", dtype: torch.dtype | None = None):
    """The transformers model of an engine folder's `role` (target / draft), on the same weights
    (assembly.load.torch_model: the folder's torch weights, or the config's source)."""
    from ..assembly.load import torch_model

    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    info = manifest["models"][role]
    spec = ModelSpec.from_dict(info["spec"])
    dtype = dtype or DTYPES[info["dtype"]]
    state = torch_model(folder, role, info, manifest["config"]).state_dict()
    return hf_model_from_state(spec, state, dtype)


class ForwardTimer:
    """Forward hooks: count and time every call of a module; the first call after reset = prefill.
    On CUDA each hook synchronizes first, so the time is the forward's, not its launch's (untested here)."""

    def __init__(self, module: torch.nn.Module, sync: bool = False):
        self._t0 = 0.0
        self._sync = sync
        self.reset()
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def reset(self) -> None:
        self.calls = 0
        self.first_seconds = 0.0
        self.seconds = 0.0

    def _pre(self, *_):
        if self._sync:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def _post(self, *_):
        if self._sync:
            torch.cuda.synchronize()
        dt = time.perf_counter() - self._t0
        if self.calls == 0:
            self.first_seconds = dt
        self.seconds += dt
        self.calls += 1


@contextlib.contextmanager
def _quiet_transformers():
    """transformers warns about internals of assisted generation (e.g. a MinNewTokens processor it
    passes itself to the assistant); the run is unaffected, the log only clutters the progress bar."""
    from transformers.utils import logging
    old = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(old)


class HFPeers:
    """transformers target (and assistant) built from an engine folder; `run(peer, ids, ...)`."""

    def __init__(self, folder: str | Path, peers: list[str], dtype: torch.dtype, lookup_tokens: int = 10,
                 device: str = "cpu"):
        bad = [p for p in peers if p not in PEERS]
        if bad:
            raise RequestError(f"unknown peer(s) {bad}; choose from {', '.join(PEERS)}")
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
        if "hf-assisted" in peers and "draft" not in manifest["models"]:
            raise RequestError("peer hf-assisted needs a draft model, and this engine folder has none; "
                             "drop it from --peers")
        self.dtype = dtype
        self.device = device                  # our engine's: cpu (tested), cuda (untested here)
        self.lookup_tokens = lookup_tokens
        self.target = hf_model_from_engine(folder, "target", dtype).to(device)
        self.draft = hf_model_from_engine(folder, "draft", dtype).to(device) if "hf-assisted" in peers else None
        sync = device.startswith("cuda")
        self.target_timer = ForwardTimer(self.target, sync)
        self.draft_timer = ForwardTimer(self.draft, sync) if self.draft is not None else None

    def settings(self) -> dict:
        return {"dtype": str(self.dtype).removeprefix("torch."), "device": self.device,
                "attn_implementation": getattr(self.target.config, "_attn_implementation", None),
                "eos": "disabled (eos_token_id=None; min_new_tokens = max_new_tokens)",
                "assisted": "transformers defaults (num_assistant_tokens=20, schedule constant, "
                            "confidence threshold 0.4)" if self.draft is not None else None,
                "prompt_lookup_num_tokens": self.lookup_tokens}

    @torch.no_grad()
    def run(self, peer: str, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
            seed: int = 0) -> tuple[list[int], dict]:
        """(new token ids, stats in the same keys as our Generator's, where they apply)."""
        kw: dict = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, use_cache=True,
                        do_sample=temperature > 0, eos_token_id=None, pad_token_id=None)
        if temperature > 0:       # plain temperature sampling, like ours with top_k 0 / top_p 1
            kw.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        if peer == "hf-assisted":
            kw["assistant_model"] = self.draft
        elif peer == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = self.lookup_tokens
        timers = [t for t in (self.target_timer, self.draft_timer) if t is not None]
        for t in timers:
            t.reset()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        with _quiet_transformers():
            t0 = time.perf_counter()
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        tt = self.target_timer
        dt = self.draft_timer if peer == "hf-assisted" else None
        prefill = tt.first_seconds + (dt.first_seconds if dt else 0.0)
        stats = {
            "new_tokens": len(new),
            "seconds": seconds,
            "tokens_per_s": len(new) / seconds if seconds > 0 else 0.0,
            "target_steps": tt.calls,                                 # target forwards (each emits >= 1 token)
            "mean_accepted": len(new) / tt.calls if tt.calls else 0.0,
            "draft_seconds": (dt.seconds - dt.first_seconds) if dt else 0.0,
            "verify_seconds": tt.seconds - tt.first_seconds,
            "prefill_seconds": prefill,
            "draft_forwards": dt.calls if dt else 0,
        }
        return new, stats
