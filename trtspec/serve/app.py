"""The OpenAI-compatible HTTP API over a loaded Generator (FastAPI; streams are server-sent events).

    POST /v1/completions  POST /v1/chat/completions  GET /v1/models  GET /health  GET /metrics  GET /version

Every request becomes one runtime request (jobs.py) on the service's engine: a Worker in this
process (worker.py), or with `serve --replicas N` one of N Ray Serve replicas (ray_serve.py), which
stream the same events back and name themselves in the `x-trtspec-replica` header. The scheduler
batches a request with whatever else runs there, so N clients share each target forward. Errors
are OpenAI's JSON error objects.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..export.contract import CONTRACT_VERSION
from ..runtime.prompts import Prompt, encode, has_chat_template
from . import logprobs as lp_json
from .jobs import Outcome
from .metrics import Metrics, merge
from .protocol import ApiError, ChatRequest, CompletionRequest, error_responses, validation_error
from .worker import Worker

CHARS_PER_TOKEN = 64
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version")
REPLICA_HEADER = "x-trtspec-replica"


@dataclass
class Service:
    """What every endpoint shares: where requests run (a Worker, or Ray replicas: ray_serve.Replicas,
    which has the same `generate`, `health`, `replica_metrics`, `close` and settings) and the HTTP
    layer's settings."""
    engine: Worker
    model: str                           # the name clients send as `model`
    api_key: str | None = None
    backend: str = ""
    max_body: int = 4 << 20              # request body bytes; larger ones get 413 before they are read
    body_timeout: float = 30.0           # seconds a request's body may take to arrive (slow clients: 408)
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = field(init=False)
    draining: bool = False

    def __post_init__(self) -> None:
        # in one process the worker's registry is the server's; replicas keep theirs (merged at /metrics)
        self.metrics = getattr(self.engine, "metrics", None) or Metrics()

    @property
    def tokenizer(self):
        return self.engine.tokenizer


def make_app(svc: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        svc.draining = True                  # uvicorn has let running requests finish (bounded)
        svc.engine.close()

    app = FastAPI(title="trtspec", version=version("trtspec"), lifespan=lifespan,
                  description="OpenAI-compatible, lossless speculative decoding. Every error is an OpenAI "
                              "error object; /metrics is Prometheus text.")
    app.add_middleware(Gate, svc=svc)
    app.openapi = lambda: openapi(app, svc.model)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):        # e.g. a body that is not UTF-8 / JSON
        detail = exc.detail if isinstance(exc.detail, str) else "bad request"
        return ApiError(exc.status_code, detail[:1].lower() + detail[1:], headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    @app.post("/v1/completions", responses=GENERATE)
    async def completions(body: CompletionRequest, request: Request):
        check_model(svc, body.model)
        prompt = body.prompt_input()
        ids = prompt if isinstance(prompt, list) else svc.tokenizer(check_size(svc, prompt, "prompt"))["input_ids"]
        return await respond(svc, body, list(ids), request, chat=False)

    @app.post("/v1/chat/completions", responses=GENERATE)
    async def chat(body: ChatRequest, request: Request):
        check_model(svc, body.model)
        if not has_chat_template(svc.tokenizer):
            raise ApiError(400, f"model {svc.model!r} has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.template_role, "content": m.text()} for m in body.messages]
        check_size(svc, "".join(m["content"] for m in messages), "messages")
        try:
            ids = encode(Prompt(id="request", messages=messages), svc.tokenizer)   # run's and bench's encoder
        except Exception as e:                       # noqa: BLE001 - jinja's TemplateError and kin
            raise ApiError(400, f"the model's chat template refused these messages: {e}", param="messages")
        return await respond(svc, body, ids, request, chat=True)

    @app.get("/v1/models", responses=error_responses(401, 503))
    async def models():
        return {"object": "list", "data": [model_card(svc)]}

    @app.get("/v1/models/{name:path}", responses=error_responses(401, 404, 503))
    async def model(name: str):
        check_model(svc, name)
        return model_card(svc)

    @app.get("/health", responses={503: {"description": "draining (the same body, status draining)"}})
    async def health():
        body = {"status": "draining" if svc.draining else "ok", **await svc.engine.health()}
        return JSONResponse(body, status_code=503 if svc.draining else 200)

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401))
    async def metrics():
        replicas = await svc.engine.replica_metrics()          # [] in a single process
        text = merge(svc.metrics.render(), replicas) if replicas else svc.metrics.render()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", responses=error_responses(401))
    async def version_():
        return {"trtspec": version("trtspec"), "contract_version": CONTRACT_VERSION, "backend": svc.backend,
                "model": svc.model, "strategies": list(svc.engine.allowed), "default_strategy": svc.engine.strategy}

    return app


# Generation endpoints: JSON, or server-sent events with `stream: true`; every error an OpenAI error object.
GENERATE = {200: {"description": "the completion (JSON), or with stream: true its chunks as server-sent events",
                  "content": {"application/json": {}, "text/event-stream": {"schema": {
                      "type": "object", "required": ["data"],
                      "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}}}}}},
            **error_responses(400, 401, 404, 408, 413, 429, 500, 503)}


def openapi(app: FastAPI, model: str) -> dict:
    """FastAPI's schema, true to this server: bad bodies are 400 OpenAI errors (our handler), never
    FastAPI's 422 validation object, so that status and its schemas are dropped; `model` is the one
    served (any other is a 404)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                for param in op.get("parameters", []):
                    if param["name"] == "name":
                        param["schema"] = {"type": "string", "enum": [model]}
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for name in ("CompletionRequest", "ChatRequest"):
            props, required = components[name]["properties"], set(components[name].get("required", []))
            for key, prop in props.items():          # an explicit null means "not given" (as OpenAI's)
                if key not in required and not any(p.get("type") == "null" for p in prop.get("anyOf", [])):
                    props[key] = {"anyOf": [{k: v for k, v in prop.items() if k not in ("title", "default")},
                                            {"type": "null"}], **{k: prop[k] for k in ("title", "default") if k in prop}}
            props["model"] = {"type": "string", "enum": [model], "title": "Model"}
        app.openapi_schema = schema
    return app.openapi_schema


def check_size(svc: Service, text: str, param: str) -> str:
    """Refuse, before tokenizing it on the event loop, a text far longer than the KV could hold
    (a token of these vocabularies is rarely over 16 characters)."""
    if len(text) > CHARS_PER_TOKEN * svc.engine.capacity:
        raise ApiError(400, f"{param} has {len(text)} characters, more than a {svc.engine.capacity}-token context "
                            "can hold", param=param, code="context_length_exceeded")
    return text


def check_model(svc: Service, name: str) -> None:
    if name != svc.model:
        raise ApiError(404, f"model {name!r} not found; this server serves {svc.model!r}", param="model",
                       code="model_not_found")


def model_card(svc: Service) -> dict:
    return {"id": svc.model, "object": "model", "created": svc.created, "owned_by": "trtspec",
            "max_model_len": svc.engine.capacity}


async def respond(svc: Service, body, ids: list[int], request: Request, chat: bool):
    """Run the request's choices on the engine: refused before it starts -> its error status; else
    one JSON body, or server-sent events, with the serving replica's name in a header."""
    events = svc.engine.generate(body, ids)
    try:
        first = await anext(events)
        if first[0] == "error":
            raise ApiError(*first[2])
    except BaseException:
        await events.aclose()
        raise
    headers = {REPLICA_HEADER: first[1]} if first[1] else {}
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.stream:
        return StreamingResponse(sse(svc, body, len(ids), events, ident, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"} | headers)
    try:
        texts, logprobs, outs = await until_done_or_gone(events, body.n, request)
    finally:
        await events.aclose()
    choices = []
    for i, out in enumerate(outs):
        choice = {"index": i, "logprobs": logprobs_json(svc, body, logprobs[i], chat),
                  "finish_reason": out.finish_reason}
        choice |= {"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]}
        choices.append(choice)
    answer = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
              "model": svc.model, "choices": choices, "usage": usage(len(ids), outs)}
    if outs[0].stats is not None:
        answer["speculative_stats"] = outs[0].stats if len(outs) == 1 else [o.stats for o in outs]
    return JSONResponse(answer, headers=headers)


def logprobs_json(svc: Service, body, logprobs: list, chat: bool, offset: int = 0) -> dict | None:
    if body.n_logprobs() is None:
        return None
    return lp_json.chat(svc.tokenizer, logprobs) if chat else lp_json.completion(svc.tokenizer, logprobs, offset)


async def until_done_or_gone(events, n: int, request: Request) -> tuple[list[str], list[list], list[Outcome]]:
    """Each choice's whole text, its tokens' logprobs and its outcome; a client that disconnects
    meanwhile cancels the request (the caller closes `events`, freeing the slots)."""
    async def collect():
        texts, logprobs, outs = [""] * n, [[] for _ in range(n)], [None] * n
        async for event in events:
            if event[0] == "piece":
                _, i, piece, lps = event
                texts[i] += piece
                logprobs[i] += lps
            elif event[0] == "end":
                outs[event[1]] = event[2]
            else:
                raise ApiError(*event[2])
        return texts, logprobs, outs
    task = asyncio.ensure_future(collect())
    try:
        while not (await asyncio.wait({task}, timeout=0.25))[0]:
            if await request.is_disconnected():
                raise ApiError(499, "client disconnected", code="client_closed_request")
        return task.result()
    finally:                                         # gone, or this coroutine cancelled (drain timeout)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


async def sse(svc: Service, body, prompt_tokens: int, events, ident: str, chat: bool):
    """Server-sent events: each choice's text deltas (interleaved as they come, by `index`), a final
    chunk per choice with its finish_reason, usage if asked, [DONE]; a failure mid-stream is a final
    error event."""
    created = int(time.time())
    extra = {"usage": None} if body.include_usage else {}
    sent = [0] * body.n                              # characters streamed per choice (completions' text_offset)

    def chunk(i: int, delta: str | None, finish: str | None = None, role: bool = False, logprobs=None,
              **more) -> str:
        lps = None if logprobs is None else logprobs_json(svc, body, logprobs, chat, sent[i])
        if chat:
            d = ({"role": "assistant"} if role else {}) | ({"content": delta} if delta is not None else {})
            choice = {"index": i, "delta": d, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta or "", "logprobs": lps, "finish_reason": finish}
        data = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": svc.model, "choices": [choice]} | extra | more
        return f"data: {json.dumps(data)}\n\n"

    outs = []
    try:
        if chat:
            for i in range(body.n):
                yield chunk(i, "", role=True)
        async for event in events:
            if event[0] == "piece":
                _, i, piece, logprobs = event
                yield chunk(i, piece, logprobs=logprobs if body.n_logprobs() is not None else None)
                sent[i] += len(piece)
            elif event[0] == "end":
                _, i, out = event
                outs.append(out)
                yield chunk(i, None, out.finish_reason, **({"speculative_stats": out.stats} if out.stats is not None else {}))
            else:                                    # a deadline or a failure mid-stream: a final error event
                yield f"data: {json.dumps(ApiError(*event[2]).body())}\n\n"
                yield "data: [DONE]\n\n"
                return
    finally:                                         # the client left, or a choice failed: nothing keeps running
        await events.aclose()
    if body.include_usage:
        data = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": svc.model, "choices": [], "usage": usage(prompt_tokens, outs)}
        yield f"data: {json.dumps(data)}\n\n"
    yield "data: [DONE]\n\n"


def usage(prompt_tokens: int, outs: list[Outcome]) -> dict:
    """The prompt once (its choices share one prefill), the completions of every choice."""
    done = sum(out.completion_tokens for out in outs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens if outs else 0}}


class Gate:
    """ASGI middleware (pure ASGI, so streaming and disconnects pass through untouched): refuses new
    work while draining, checks the API key (every path but /health), counts responses by status."""

    def __init__(self, app, svc: Service):
        self.app, self.svc = app, svc

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
        status = 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope, path)
            if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
                refusal, receive = await self.whole_body(scope, receive)
            if refusal is not None:
                await refusal.response()(scope, receive, counted)
            else:
                await self.app(scope, receive, counted)
        finally:
            self.svc.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    async def whole_body(self, scope, receive):
        """Read the body before the app sees it: over `max_body` bytes (by its Content-Length, before
        reading anything, or as it arrives) is a 413, not arriving within `body_timeout` a 408. A
        slow client so holds a connection for at most that long, and never a slot (requests take
        one only once parsed). Returns (refusal or None, a receive that replays the body)."""
        limit = self.svc.max_body
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return ApiError(413 if declared.isdigit() else 400, f"the request body is over the server's limit of "
                            f"{limit} bytes" if declared.isdigit() else "bad Content-Length header",
                            code="request_too_large" if declared.isdigit() else None), receive
        loop = asyncio.get_running_loop()
        deadline, size, messages = loop.time() + self.svc.body_timeout, 0, []
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                return ApiError(408, f"the request body did not arrive within {self.svc.body_timeout:g} s",
                                code="body_timeout"), receive
            messages.append(message)
            if message["type"] != "http.request":
                break                                # a disconnect: the app sees it
            size += len(message.get("body", b""))
            if size > limit:
                return ApiError(413, f"the request body is over the server's limit of {limit} bytes",
                                code="request_too_large"), receive
            if not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        return None, replay

    def refusal(self, scope, path: str) -> ApiError | None:
        if path == "/health":
            return None
        if self.svc.api_key:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.svc.api_key.encode()):
                return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                code="invalid_api_key")
        if self.svc.draining and path.startswith("/v1/"):
            return ApiError(503, "the server is shutting down", code="draining")
        return None
