"""The HTTP server: OpenAI's routes over an ``AsyncEngine``, and nothing else.

Thin on purpose (vLLM's ``api_server``): a request body becomes a prompt and
``SamplingParams``, the engine's outputs become OpenAI's JSON or server-sent events. The
engine does the scheduling, the caching and the checks of prompt lengths and token ids;
this layer adds the wire format, the error shapes and the per-request latencies.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with one line naming the
field: 400 for bad JSON, a bad field or a request the engine refuses, 404 for an unknown
model or route, 429 with ``Retry-After`` when the engine's queue is full, 500 only for a
bug (logged here, never sent as a traceback). A client that goes away cancels its request,
which frees its KV blocks.
"""

from __future__ import annotations

import base64
import difflib
import json
import logging
import math
import re
import struct
import uuid
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import UsageError
from .api_metrics import ApiMetrics, RequestTimer
from .async_engine import QueueFull
from .chat_template import compile_chat_template, render_chat
from .openai_protocol import (
    ChatFormat, ChatRequest, CompletionFormat, CompletionRequest, EmbeddingRequest, TranslationRequest,
    envelope, now, texts_of, usage,
)
from .params import SamplingParams

log = logging.getLogger(__name__)

# A field whose value may take several shapes: what a union's validation error should say.
EXPECTED = {
    "prompt": "a string or a list of token ids",
    "stop": "a string or a list of strings",
    "input": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
          "/v1/embeddings": EmbeddingRequest, "/v1/translations": TranslationRequest}
ROUTE_ARCH = {"completions": "decoder", "chat completions": "decoder", "embeddings": "encoder",
              "translations": "encoder-decoder"}
ROUTE_ARCH_OF = {"decoder": "completions", "encoder": "embeddings", "encoder-decoder": "translations"}


class ApiError(Exception):
    """An error with its HTTP status, sent in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def build_app(aeng, *, model_name: str, chat_template: str | None = None) -> FastAPI:
    """The app serving ``aeng`` (started by the caller) under ``model_name``. Chat needs
    ``chat_template`` (Jinja, as Hugging Face writes them); without one it answers 400."""
    server = _Server(aeng, model_name, compile_chat_template(chat_template) if chat_template else None)
    app = FastAPI(title="blockformer", version="1", docs_url=None, redoc_url=None)
    app.state.server = server
    _add_error_handlers(app, server.metrics)
    _add_routes(app, server)
    return app


class _Server:
    """What the routes share: the engine, the model's name and template, the metrics."""

    def __init__(self, aeng, model_name: str, template) -> None:
        self.aeng = aeng
        self.engine = aeng.engine
        self.model_name = model_name
        self.template = template
        self.metrics = ApiMetrics(aeng.stats)
        self.created = now()

    def check(self, model: str | None, route: str) -> None:
        """The request names this model (or none) and the model's kind serves the route."""
        if model not in (None, "", self.model_name):
            raise ApiError(404, f"model: {model!r} is not served here; expected {self.model_name!r}",
                           param="model", code="model_not_found")
        needs, arch = ROUTE_ARCH[route], self.engine.arch
        if arch != needs:
            raise ApiError(400, f"model: {self.model_name!r} is {_a(arch)} model; {route} need {_a(needs)} "
                           f"(it serves /v1/{ROUTE_ARCH_OF[arch]})",
                           param="model", code="wrong_model_kind")

    def room(self, prompt_ids: list[int]) -> int:
        """The default ``max_tokens``: what the context leaves after the prompt (at least 1,
        so that a prompt too long is the engine's one refusal naming it)."""
        return max(1, self.engine.max_context - len(prompt_ids))

    async def generate(self, request: Request, prompt: str | list[int], params: SamplingParams, fmt,
                       stream: bool, include_usage: bool) -> Response:
        """Run one request: a JSON response, or an event stream once its first output exists
        (so that a refusal is still an HTTP status, not an event)."""
        request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        reply = _Reply(self, request_id, fmt, params.logprobs is not None,
                       self.aeng.generate(prompt, params, request_id=request_id), self.metrics.track())
        try:
            first = await reply.next()  # the engine refuses here: QueueFull, UsageError
        except BaseException:
            await _close(reply.outputs)  # a refusal is not a finished request: no latencies
            raise
        if stream:
            return _EventStream(reply.events(first, include_usage), reply.close)
        return await reply.collect(first, request)


class _Reply:
    """One request's outputs, shaped as OpenAI's choices; ``close`` ends it (an abort in
    the engine unless it finished) and records its latencies once."""

    def __init__(self, server: _Server, request_id: str, fmt, logprobs: bool, outputs, timer: RequestTimer) -> None:
        self.server, self.id, self.fmt, self.want_logprobs = server, request_id, fmt, logprobs
        self.outputs, self.timer, self.reason = outputs, timer, "abort"
        self.created = now()

    async def next(self):
        """The engine's next output; its finishing with an error, or its thread stopped, is
        a 5xx naming why (the engine's own message, not a traceback)."""
        try:
            out = await self.outputs.__anext__()
        except RuntimeError as e:  # AsyncEngine: "the engine is not running" / "the engine stopped: ..."
            raise ApiError(503, str(e), code="engine_unavailable") from None
        if out.finished and out.finish_reason == "error":
            self.reason = "error"
            raise ApiError(500, f"the engine failed on this request: {out.error or 'no reason given'}")
        self.timer.tokens_made(len(out.token_ids))
        return out

    async def close(self) -> None:
        await _close(self.outputs)
        self.timer.finish(self.reason)

    def _envelope(self, obj: str, choices: list, **extra) -> dict[str, Any]:
        return envelope(self.id, obj, self.server.model_name, self.created, choices, **extra)

    async def collect(self, out, request: Request) -> Response:
        """The whole completion as one JSON body; a client gone meanwhile aborts it."""
        text, pieces = [out.text], list(out.logprobs or [])
        try:
            while not out.finished:
                if await request.is_disconnected():
                    return Response(status_code=499)
                out = await self.next()
                text.append(out.text)
                pieces.extend(out.logprobs or [])
            self.reason = out.finish_reason or "stop"
        finally:
            await self.close()
        logprobs = self.fmt.logprobs(pieces) if self.want_logprobs else None
        choice = self.fmt.choice("".join(text), logprobs, self.reason)
        return JSONResponse(self._envelope(self.fmt.object, [choice], usage=usage(out)))

    async def events(self, out, include_usage: bool):
        """Server-sent events: a chunk per output with text, the last with its finish
        reason, then usage if asked, then ``[DONE]``; an engine failure midway is an
        ``error`` event, as vLLM sends it."""
        chunk = self.fmt.chunk_object
        try:
            opening = self.fmt.opening()
            if opening is not None:
                yield _sse(self._envelope(chunk, [opening]))
            while not out.finished:
                if out.text or out.logprobs:
                    yield _sse(self._envelope(chunk, [self.fmt.delta(out.text, self._logprobs(out), None)]))
                out = await self.next()
            self.reason = out.finish_reason or "stop"
            yield _sse(self._envelope(chunk, [self.fmt.delta(out.text, self._logprobs(out), self.reason)]))
            if include_usage:
                yield _sse(self._envelope(chunk, [], usage=usage(out)))
        except ApiError as e:
            yield _sse(e.body())
        finally:
            await self.close()
        yield "data: [DONE]\n\n"

    def _logprobs(self, out):
        return self.fmt.logprobs(out.logprobs or []) if self.want_logprobs else None


class _EventStream(StreamingResponse):
    """An SSE response that always ends its request, however the response ends: a
    disconnect cancels the stream, an error in ``send`` would leave it open, a disconnect
    before the first event would never start it. So the engine hears of the abort at
    once, not when the generator is garbage-collected."""

    media_type = "text/event-stream"

    def __init__(self, events, close) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _close(self.body_iterator)
            await self.close()


async def _close(agen) -> None:
    """``aclose`` shielded from the cancellation that may be closing it."""
    with anyio.CancelScope(shield=True):
        await agen.aclose()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def _add_routes(app: FastAPI, server: _Server) -> None:
    tokenizer = server.engine.tokenizer

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check(body.model, "completions")
        body.check()
        prompt = body.prompt
        if body.max_tokens is None and isinstance(prompt, str):
            prompt = tokenizer.encode(prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else server.room(prompt)
        params = body.sampling_params(max_tokens, body.logprobs)
        return await server.generate(request, prompt, params, CompletionFormat(tokenizer.decode),
                                     body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        server.check(body.model, "chat completions")
        if server.template is None:
            raise ApiError(400, f"messages: {server.model_name!r} has no chat template; expected a checkpoint "
                           "with one or `blockformer serve --chat-template FILE` (or use /v1/completions)",
                           param="messages", code="no_chat_template")
        body.check()
        prompt = tokenizer.encode(render_chat(server.template, [m.for_template() for m in body.messages]))
        limit = body.token_limit
        params = body.sampling_params(limit if limit is not None else server.room(prompt), body.engine_logprobs)
        return await server.generate(request, prompt, params, ChatFormat(tokenizer.decode),
                                     body.stream, body.include_usage)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        server.check(body.model, "embeddings")
        vectors, tokens = await server.aeng.embed(texts_of(body.input), pooling=body.pooling)
        data = [{"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": server.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/v1/translations")
    async def translations(body: TranslationRequest) -> dict[str, Any]:
        server.check(body.model, "translations")
        texts, prompt_tokens, completion_tokens = await server.aeng.translate(
            texts_of(body.input), beam_size=body.beam_size, max_tokens=body.max_tokens)
        return {"id": f"trans-{uuid.uuid4().hex}", "object": "translation", "created": now(),
                "model": server.model_name, "data": [{"index": i, "text": t} for i, t in enumerate(texts)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def model_card() -> dict[str, Any]:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "blockformer",
                "max_model_len": server.engine.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        server.check(model, ROUTE_ARCH_OF.get(server.engine.arch, "completions"))
        return model_card()

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not server.aeng.alive:  # the engine's thread stopped (an error, or shut down)
            raise ApiError(503, f"the engine is not running: {server.aeng.error or 'stopped'}", code="engine_stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _vector(values: list[float], encoding: str) -> list[float] | str:
    """OpenAI's ``base64`` encoding is the float32 little-endian bytes (its client's default)."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


# Errors


def _add_error_handlers(app: FastAPI, metrics: ApiMetrics) -> None:
    def reply(e: ApiError) -> JSONResponse:
        metrics.errors.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return reply(e)

    @app.exception_handler(UsageError)
    async def usage_error(request: Request, e: UsageError) -> JSONResponse:
        return reply(ApiError(400, str(e), param=_param_of(str(e))))

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, e: QueueFull) -> JSONResponse:
        seconds = max(1, math.ceil(getattr(e, "retry_after", 1) or 1))
        message = f"the server is busy: its queue is full ({e}); retry after {seconds} s"
        return reply(ApiError(429, message, type="rate_limit_error", code="queue_full",
                              headers={"Retry-After": str(seconds)}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(e.errors(), BODIES.get(request.url.path))
        return reply(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        if e.status_code == 404:
            message += "; expected one of " + ", ".join(sorted({*BODIES, "/v1/models", "/health", "/metrics"}))
        error = ApiError(e.status_code, message, type="not_found_error" if e.status_code == 404 else None)
        error.headers = dict(e.headers) if e.headers else None
        return reply(error)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return reply(ApiError(500, f"internal error ({type(e).__name__}); the server log has the details"))


def _param_of(message: str) -> str | None:
    """The field a ``UsageError`` names: its messages start with ``name: ...``."""
    match = re.match(r"([A-Za-z_][\w.]*)(\[\d+\])?:", message)
    return match.group(1) if match else None


def validation_message(errors, body_model=None) -> tuple[str, str | None]:
    """One line for pydantic's errors, naming the first bad field, and that field."""
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return f"request body: not valid JSON ({reason}); expected a JSON object", None
    path = _field_path(first["loc"])
    if not path:
        return f"request body: {_show(first.get('input'))}; expected a JSON object", None
    if first["type"] == "missing":
        return f"{path}: missing; expected this field", path
    if first["type"] == "extra_forbidden":
        known = list(body_model.model_fields) if body_model is not None else []
        close = difflib.get_close_matches(path.rpartition(".")[2], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{path}: an unknown field{hint}; expected one of {', '.join(known)}" if known else \
            f"{path}: an unknown field", path
    top = re.split(r"[.\[]", path)[0]
    union = sum(re.split(r"[.\[]", _field_path(e["loc"]))[0] == top for e in errors) > 1
    name = re.split(r"[.\[]", path.rpartition(".")[2])[0]
    if union and name in EXPECTED:
        expected = f"expected {EXPECTED[name]}"
    else:
        expected = first["msg"].replace("Input should be ", "expected ")
    return f"{path}: {_show(first.get('input'))}; {expected}", path


def _field_path(loc) -> str:
    """``("body", "messages", 0, "content", "str")`` -> ``messages[0].content``: the body
    marker and pydantic's union-member tags (``str``, ``list[int]``) dropped."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in {"str", "int", "float", "bool", "list", "dict"}:
            path += f".{part}" if path else part
    return path


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
