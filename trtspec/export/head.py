"""A head: a small model that drafts from the target's hidden rows (a model role of its own: `heads:`).

Medusa-1 (Cai et al. 2024): head k (1..depth) maps the row h whose logits chose the last emitted
token to h + SiLU(W_k h + b_k) and reads that with its own LM head: its guess of the token k places
after it. The LM head may cover part of the vocabulary (`ids`: the token of each of its rows, e.g.
the draft head's most frequent tokens); a head never proposes a token outside it, and since the
target verifies every token, outputs do not depend on it.

A head file is safetensors: `blocks.{k}.weight` [H, H] and `blocks.{k}.bias` [H] for k = 0..depth-1,
`lm_head.weight` [R, H], and optionally `ids` [R] (int64; absent: tokens 0..R-1). `read_head`
checks one against the target it reads (hidden size, vocabulary) in one line.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .spec import SpecError

KINDS = ("medusa",)


@dataclass(frozen=True)
class HeadSpec:
    kind: str
    hidden_size: int
    depth: int               # tokens ahead it guesses (heads)
    rows: int                # rows of its LM head (tokens it can propose)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, state: dict[str, torch.Tensor], kind: str = "medusa") -> "HeadSpec":
        """The spec of a head file's tensors (its blocks, its LM head's rows and width)."""
        depth = sum(1 for k in state if k.startswith("blocks.") and k.endswith(".weight"))
        rows, hidden = state["lm_head.weight"].shape
        return cls(kind, hidden, depth, rows)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadSpec":
        spec = cls(**d)
        if spec.kind not in KINDS or min(spec.hidden_size, spec.depth, spec.rows) < 1:
            raise ValueError(f"not a head spec: {d}")
        return spec


class MedusaHead(torch.nn.Module):
    def __init__(self, spec: HeadSpec, state: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.w = torch.stack([state[f"blocks.{k}.weight"] for k in range(spec.depth)]).float()    # [K, H, H]
        self.b = torch.stack([state[f"blocks.{k}.bias"] for k in range(spec.depth)]).float()      # [K, H]
        self.lm = state["lm_head.weight"].float()                                                   # [R, H]
        self.ids = state["ids"].long() if "ids" in state else torch.arange(spec.rows)

    def to(self, device) -> "MedusaHead":
        for name in ("w", "b", "lm", "ids"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @property
    def device(self) -> torch.device:
        return self.lm.device

    @classmethod
    def echo(cls, lm: torch.Tensor, depth: int = 3) -> "MedusaHead":
        """Zero blocks under `lm` (h + SiLU(0) = h): every head names the LM head's argmax of the row,
        i.e. the root after a step, with the target's own LM head: a plumbing check (tests, the
        device check), never a drafter that pays."""
        h = lm.shape[1]
        state = {f"blocks.{k}.{p}": torch.zeros((h, h) if p == "weight" else (h,)) for k in range(depth)
                 for p in ("weight", "bias")}
        state["lm_head.weight"] = lm.detach().float().cpu()
        return cls(HeadSpec.of(state), state)

    @torch.no_grad()
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, H] -> logits [N, depth, R] over its LM head's rows."""
        rows = rows.float()
        y = rows[:, None, :] + torch.nn.functional.silu(torch.einsum("nh,kgh->nkg", rows, self.w) + self.b)
        return y @ self.lm.T

    @torch.no_grad()
    def top(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, tokens) [N, depth, k]: each head's k most likely tokens after each row."""
        probs, idx = torch.softmax(self.forward(rows.to(self.device)), -1).topk(min(k, self.spec.rows), -1)
        return probs, self.ids[idx]


def read_head(path: str | Path, hidden_size: int, vocab_size: int, kind: str = "medusa"
              ) -> tuple[HeadSpec, dict[str, torch.Tensor]]:
    """A head file's spec and tensors (fp32), checked against the target it reads; SpecError in one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    fix = "write it as docs/design.md (\"Adding a head\") describes, or fix heads.NAME.model"
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise SpecError(f"head {path}: cannot be read as safetensors ({' '.join(str(e).split())[:160]}); "
                        f"{fix}") from None
    depth = sum(1 for k in state if k.startswith("blocks.") and k.endswith(".weight"))
    lm = state.get("lm_head.weight")
    need = [f"blocks.{k}.{p}" for k in range(depth) for p in ("weight", "bias")] + ["lm_head.weight"]
    missing = [k for k in need if k not in state]
    if missing or not depth:
        raise SpecError(f"head {path} has no {missing[0] if missing else 'blocks.0.weight'}; {fix}")
    shapes = {f"blocks.{k}.weight": (hidden_size, hidden_size) for k in range(depth)}
    shapes |= {f"blocks.{k}.bias": (hidden_size,) for k in range(depth)}
    shapes["lm_head.weight"] = (lm.shape[0], hidden_size)
    if "ids" in state:
        shapes["ids"] = (lm.shape[0],)
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise SpecError(f"head {path}: {name} is {list(state[name].shape)}, the target's hidden size "
                            f"{hidden_size} needs {list(shape)}; {fix}")
    ids = state.get("ids", torch.arange(lm.shape[0]))
    if ids.dtype.is_floating_point or len(ids) == 0 or ids.min() < 0 or ids.max() >= vocab_size \
            or len(ids.unique()) < len(ids):
        raise SpecError(f"head {path}: ids must be distinct token ids below the target's vocabulary "
                        f"({vocab_size}), one per LM head row; {fix}")
    extra = sorted(set(state) - set(shapes))
    if extra:
        raise SpecError(f"head {path}: unexpected tensor {extra[0]}; {fix}")
    state = {k: (v.long() if k == "ids" else v.float()) for k, v in state.items()}
    return HeadSpec.of(state, kind), state


def load_head(spec: dict, path: str | Path, device: str = "cpu") -> MedusaHead:
    """A built folder's head (its manifest spec and weights file) on `device`."""
    from safetensors.torch import load_file
    return MedusaHead(HeadSpec.from_dict(spec), load_file(str(path))).to(device)
