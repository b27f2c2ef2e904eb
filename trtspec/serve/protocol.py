"""The OpenAI request bodies `trtspec serve` accepts, and its OpenAI-style errors.

Unknown fields are refused with a 400 naming them, and so are OpenAI fields whose effect we do not
implement (echo, best_of, suffix, tools): a client must never get an answer to a question it
did not ask. Harmless fields (`user`, `metadata`, `store`) are accepted and ignored.

Implemented, exact under every strategy: `presence_penalty`, `frequency_penalty`, `logit_bias`,
`response_format` (`json_object`, `json_schema`), `logprobs` (+ `top_logprobs` in chat), `n`.

Extensions a client passes through the `openai` client's `extra_body`: `top_k`, `timeout`
(seconds), `ignore_eos`, `repetition_penalty`, `min_tokens`, `stop_token_ids` (as vLLM's),
`structured_outputs` (exactly one of `regex`, `grammar` (Lark), `json` (a schema), as vLLM's) and
`speculative` (`strategy`, that strategy's options, and `stats: true` for per-request statistics).
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

    def state(self) -> tuple:
        """Plain values that cross a process boundary (worker.py's events); `ApiError(*state)` again."""
        return self.status, self.message, self.param, self.code, self.headers

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
_NEUTRAL = {"echo": (None, False), "best_of": (None, 1),
            "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
            "function_call": (None, "none"), "parallel_tool_calls": (None, False)}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None           # the schema is always enforced (as with strict: true)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (off), any JSON object, or a JSON schema."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ApiError(400, "response_format: json_schema (with a schema) goes with type json_schema, and only "
                                "with it", param="response_format")
        return self


class StructuredOutputs(BaseModel):
    """Extension (vLLM's `structured_outputs`): exactly one of a regex, a Lark grammar, a JSON schema."""
    model_config = ConfigDict(extra="forbid", strict=True)
    regex: str | None = None
    grammar: str | None = None
    json_: dict | None = Field(None, alias="json")

    @model_validator(mode="after")
    def _one(self):
        if sum(x is not None for x in (self.regex, self.grammar, self.json_)) != 1:
            raise ApiError(400, "structured_outputs takes exactly one of regex, grammar (Lark) or json (a schema)",
                           param="structured_outputs")
        return self


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
    n: int = Field(1, ge=1, le=128)                                       # choices (jobs.py: at most 4 per slot)
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)       # extension: seconds
    ignore_eos: bool = False                                              # extension (as vLLM's): benchmarks
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, le=10, allow_inf_nan=False)   # extension (as vLLM's)
    logit_bias: dict[str, float] | None = None                            # token id (as a string) -> [-100, 100]
    min_tokens: int = Field(0, ge=0)                                      # extension (as vLLM's)
    stop_token_ids: list[int] | None = Field(None, max_length=64)         # extension (as vLLM's)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None                   # extension (as vLLM's)
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
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"each stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ApiError(400, f"logit_bias keys are token ids (as strings), got {key!r}", param="logit_bias")
            if not -100 <= bias <= 100:
                raise ApiError(400, f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ApiError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        return self

    def grammar(self):
        """The output's grammar (runtime.grammar.Grammar), or None."""
        import json

        from ..runtime.grammar import Grammar
        so, rf = self.structured_outputs, self.response_format
        if so is not None:
            if so.regex is not None:
                return Grammar("regex", so.regex)
            if so.grammar is not None:
                return Grammar("lark", so.grammar)
            return Grammar("json_schema", json.dumps(so.json_))
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return Grammar("json_object", "")
        return Grammar("json_schema", json.dumps(rf.json_schema.schema_))

    def n_logprobs(self) -> int | None:
        """How many alternatives per token to report (None: no logprobs)."""
        return None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if s]

    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]      # strict: token ids are ints, never coerced bools
    logprobs: int | None = Field(None, ge=0, le=20)             # alternatives per token (OpenAI: at most 5)

    def n_logprobs(self) -> int | None:
        return self.logprobs

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
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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
