"""Weight-only int8 for draft models (torch backend): dynamic quantization of every Linear.

A draft's precision never changes the output (verification is exact against the target), only
how often its guesses are accepted, so a 2-3x cheaper draft forward is a free win on CPU. The
target is never quantized by trtspec: its precision is the user's choice.
"""
from __future__ import annotations

import warnings

import torch

from ..export.model import Decoder

QUANT_MODES = ("none", "int8")


def quantize_decoder(model: Decoder, mode: str) -> Decoder:
    if mode == "none":
        return model
    if mode != "int8":
        raise ValueError(f"quantize mode {mode!r} is not one of {', '.join(QUANT_MODES)}")
    if model.model.embed_tokens.weight.dtype != torch.float32:
        model = model.float()              # dynamic int8 kernels take float32 activations
        model.inv_freq = model.inv_freq.float()
    with warnings.catch_warnings():        # torch.ao prints a migration notice on every call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
