"""The OpenAI request bodies `trtspec serve` accepts, and its OpenAI-style errors.

Unknown fields are refused with a 400 naming them, and so are OpenAI fields whose effect we do not
implement (penalties, logprobs, n > 1, tools): a client must never get an answer to a question it
did not ask. Harmless fields (`user`, `metadata`, `store`) are accepted and ignored. Extensions a
client passes through the `openai` client's `extra_body`: `top_k`, `timeout` (seconds), `ignore_eos`
(as vLLM's) and `speculative` (`strategy`, that strategy's options, and `stats: true` for
per-request statistics).
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOPS = 4
MAX_STOP_CHARS = 256          # per stop string: the hold-back check runs on every step


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.status == 408 or self.status >= 500 and self.status != 503:
            headers["x-should-retry"] = "false"      # the openai client would re-run the whole generation
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class Speculative(BaseModel):
    """`{"strategy": "staged", "budget": 24, "stats": true}`: the strategy, its options, and whether
    the answer carries speculation statistics. Options not given come from the server's config."""
    model_config = ConfigDict(extra="allow", strict=True)
    strategy: str | None = None
    stats: bool = False

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


# OpenAI fields accepted only at the value that means "off", since nothing here implements them.
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (None, False),
            "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1), "logit_bias": (None, {}),
            "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
            "function_call": (None, "none"), "parallel_tool_calls": (None, False),
            "response_format": (None, {"type": "text"})}


class _Sampling(BaseModel):
    # strict: a JSON 0 is not a boolean, "5" is not a number (the schema says which type each field is)
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)   # OpenAI's default and range
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)                                          # extension; 0 or -1 = off
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)              # torch.Generator's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": 1})      # checked in _supported (its message)
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)       # extension: seconds
    ignore_eos: bool = False                                              # extension (as vLLM's): benchmarks
    speculative: Speculative | None = None
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        """An explicit null means "not given" (OpenAI accepts null for every optional field)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _supported(self):
        extra = dict(self.model_extra or {})
        for name, value in extra.items():
            if name not in _NEUTRAL:
                raise ApiError(400, f"unknown field {name!r}", param=name, code="unknown_field")
            if value not in _NEUTRAL[name] and not (isinstance(value, float) and value == 0 and 0 in _NEUTRAL[name]):
                raise ApiError(400, f"{name} is not supported by this server (send {_NEUTRAL[name][-1]!r} or leave "
                                    "it out)", param=name, code="unsupported_field")
        if self.n != 1:
            raise ApiError(400, f"n must be 1 (one choice per request), got {self.n}; send separate requests",
                           param="n")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"each stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if s]

    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]      # strict: token ids are ints, never coerced bools

    def prompt_input(self) -> str | list[int]:
        """The one prompt, as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"one prompt per request, got {len(p)}; send a request per prompt", param="prompt")
            p = p[0]
        if not p:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)   # tool_calls etc.: refused, not dropped
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None                          # accepted; chat templates do not use it

    @property
    def template_role(self) -> str:
        """OpenAI's `developer` is the system prompt of newer models; templates know `system`."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return min(self.max_tokens, self.max_completion_tokens)
        return self.max_completion_tokens or self.max_tokens


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI's RequestValidationError list -> one 400 naming the first bad field."""
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                        code="invalid_json")
    if not loc and isinstance(err.get("input"), (bytes, str)):
        return ApiError(400, "the request body must be a JSON object (send Content-Type: application/json)",
                        code="invalid_json")
    param = ".".join(loc) or None
    value = err.get("input")
    shown = "" if err.get("type") == "missing" or isinstance(value, dict) else f" (got {value!r:.60})"
    return ApiError(400, f"{param or 'body'}: {err['msg']}{shown}", param=param)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error this server answers (OpenAI's error object), for the OpenAPI schema."""
    error: ErrorDetail


def error_responses(*statuses: int) -> dict:
    """FastAPI `responses=` documenting these statuses as OpenAI error objects."""
    why = {400: "a bad field (named in `param`), or prompt + max_tokens over the KV capacity",
           401: "missing or wrong API key", 404: "unknown model", 408: "the request's deadline passed, or its "
           "body did not arrive in time", 413: "the request body is larger than the server's limit",
           429: "too many requests already wait for a slot (see Retry-After)", 500: "an internal error", 503: "the server is shutting down"}
    return {s: {"model": ErrorResponse, "description": why[s]} for s in statuses}
