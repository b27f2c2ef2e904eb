"""Typed, bounded options, checked by pydantic and reported in one line.

Configs, strategy options and sampling settings all declare their fields with the aliases below
(`Annotated` types carrying their bounds), so a wrong type, an out-of-range value, `nan`, or an
unknown key is refused where it is read, naming the key, the value and what is allowed.
"""
from __future__ import annotations

import functools
import inspect
from typing import Annotated, Any, Callable

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, validate_call

from .errors import ConfigError

# Largest number of new tokens one model call takes (ModelRunner's step buffers are sized by it).
MAX_STEP_TOKENS = 256
# Prompt tokens per prefill call; chunks end at multiples of it, and the prefix cache stores blocks of
# it (runtime/prefix_cache.py), so a stored row is the row a cold prefill computes, bit for bit.
PREFILL_CHUNK = 64

STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=False)

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TreeSize = Annotated[int, Field(ge=1, le=MAX_STEP_TOKENS - 1)]     # nodes a step may add to a tree
Depth = Annotated[int, Field(ge=1, le=MAX_STEP_TOKENS - 1)]


def _drafters(v: Any) -> Any:
    """A strategy's drafters (runtime/drafters/base.py): a name, names joined by "+", or a list of 1 to 8
    names, in the order it asks them (one error for all three forms)."""
    names = v.split("+") if isinstance(v, str) else v
    if type(names) is list and 1 <= len(names) <= 8 and all(type(n) is str and 1 <= len(n) <= 64 for n in names):
        return v
    raise ValueError("should be a drafter's name, or a list of 1 to 8 names (or names joined by '+')")


Drafters = Annotated[Any, PlainValidator(_drafters)]


def auto_or(most: int):
    """"auto" or an integer in 1..most (one error naming both, not pydantic's per-branch union errors)."""
    def check(v: Any) -> Any:
        if v == "auto" or (type(v) is int and 1 <= v <= most):
            return v
        raise ValueError(f"should be 'auto' or an integer in 1..{most}")
    return Annotated[Any, PlainValidator(check)]


# A tree strategy's node budget: a fixed number, or "auto" (sized every step: runtime/budget/auto.py).
Budget = auto_or(MAX_STEP_TOKENS - 1)


class Strict(BaseModel):
    """Base of every config section: strict types (no "3" for 3, no true for 1), no unknown keys."""
    model_config = STRICT


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p not in ("function-after", "function-before"))


def one_line(err: ValidationError, where: str, allowed: list[str] | Callable[[tuple], list[str]] | None = None
             ) -> str:
    """The first problem of a pydantic error as `where.key = value: what is wrong`. `allowed`: the
    keys to suggest for an unknown key (or a function of the unknown key's parent location)."""
    e = err.errors(include_url=False)[0]
    key = _loc(e["loc"])
    if callable(allowed):
        allowed = allowed(tuple(e["loc"][:-1]))
    name = f"{where}.{key}" if where and key else (where or key)
    msg = e["msg"].replace("Input should be", "should be").replace("Value error, ", "")
    if not name:                      # a check across fields: its message names the keys itself
        return msg
    if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        tail = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return f"{name}: unknown key{tail}"
    if e["type"] == "missing" or e["type"] == "missing_argument":
        return f"{name}: required"
    if e["type"] == "unexpected_positional_argument":
        return f"{where}: too many positional arguments"
    return f"{name} = {e.get('input')!r}: {msg}"


def checked_init(where: str):
    """Decorator for an `__init__` whose parameters carry `Annotated` bounds: validates every call
    and raises ConfigError(one line) naming `where.key`."""
    def wrap(init):
        validated = validate_call(config=ConfigDict(strict=True, allow_inf_nan=False, arbitrary_types_allowed=True))(init)
        allowed = [p for p in inspect.signature(init).parameters if p != "self"]

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if len(args) > len(allowed):
                raise ConfigError(f"{where}: takes at most {len(allowed)} options ({', '.join(allowed)}), "
                                  f"got {len(args)} positional values")
            named = dict(zip(allowed, args))          # so errors name positional options too
            if named.keys() & kwargs.keys():
                raise ConfigError(f"{where}: {sorted(named.keys() & kwargs.keys())} given twice")
            try:
                validated(self, **named, **kwargs)
            except ValidationError as e:
                raise ConfigError(one_line(e, where, allowed)) from None
        __init__.allowed = allowed
        return __init__
    return wrap
