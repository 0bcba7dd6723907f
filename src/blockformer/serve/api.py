"""The HTTP server: OpenAI's routes over an ``AsyncEngine``, and nothing else.

Thin on purpose (vLLM's ``api_server``): a request body becomes a prompt and
``SamplingParams``, the engine's outputs become OpenAI's JSON or server-sent events. The
engine does the scheduling, the caching and the checks of prompt lengths and token ids;
this layer adds the wire format, the error shapes (api_errors.py) and the per-request
latencies (api_metrics.py). A client that goes away, streaming or not, aborts its request
in the engine, which frees its KV blocks.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (decoders), ``/v1/embeddings``
(encoders), ``/v1/translations`` (encoder-decoders), ``/v1/models``, ``/health``,
``/metrics``.
"""

from __future__ import annotations

import base64
import json
import struct
import uuid
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import UsageError
from .api_errors import ApiError, add_error_handlers
from .api_metrics import ApiMetrics, RequestTimer
from .chat_template import compile_chat_template, render_chat
from .openai_protocol import (
    ChatFormat, ChatRequest, CompletionFormat, CompletionRequest, EmbeddingRequest, TranslationRequest,
    envelope, now, texts_of, usage,
)
from .params import SamplingParams

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
          "/v1/embeddings": EmbeddingRequest, "/v1/translations": TranslationRequest}
ROUTES = [*BODIES, "/v1/models", "/health", "/metrics"]
ARCH_ROUTE = {"decoder": "/v1/completions", "encoder": "/v1/embeddings", "encoder-decoder": "/v1/translations"}
ROUTE_ARCH = {"/v1/completions": "decoder", "/v1/chat/completions": "decoder", "/v1/embeddings": "encoder",
              "/v1/translations": "encoder-decoder"}


def build_app(aeng, *, model_name: str, chat_template: str | None = None) -> FastAPI:
    """The app serving ``aeng`` (started by the caller) under ``model_name``. Chat needs
    ``chat_template`` (Jinja, as Hugging Face writes them); without one it answers 400."""
    server = _Server(aeng, model_name, compile_chat_template(chat_template) if chat_template else None)
    app = FastAPI(title="blockformer", version="1", docs_url=None, redoc_url=None)
    app.state.server = server
    add_error_handlers(app, lambda status: server.metrics.errors.labels(status=str(status)).inc(), BODIES, ROUTES)
    for path, method in [("/v1/completions", server.completions), ("/v1/chat/completions", server.chat),
                         ("/v1/embeddings", server.embeddings), ("/v1/translations", server.translations)]:
        app.add_api_route(path, method, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", server.model, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.scrape, methods=["GET"])
    return app


class _Server:
    """The routes, over one engine, one model name and its template, one set of metrics."""

    def __init__(self, aeng, model_name: str, template) -> None:
        self.aeng, self.engine = aeng, aeng.engine
        self.model_name, self.template = model_name, template
        self.tokenizer = self.engine.tokenizer
        self.metrics = ApiMetrics(aeng.stats)
        self.created = now()

    # --- routes ---

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check(body.model, "/v1/completions")
        body.check()
        prompt = body.prompt
        if body.max_tokens is None and isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)  # its length sets the default
        max_tokens = body.max_tokens if body.max_tokens is not None else self.room(prompt)
        params = body.sampling_params(max_tokens, body.logprobs)
        fmt = CompletionFormat(self.tokenizer.decode)
        return await self.generate(request, prompt, params, fmt, body.stream, body.include_usage)

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        self.check(body.model, "/v1/chat/completions")
        if self.template is None:
            raise ApiError(400, f"messages: {self.model_name!r} has no chat template; expected a checkpoint with "
                           "one or `blockformer serve --chat-template FILE` (or use /v1/completions)",
                           param="messages", code="no_chat_template")
        body.check()
        prompt = self.tokenizer.encode(render_chat(self.template, [m.for_template() for m in body.messages]))
        limit = body.token_limit
        params = body.sampling_params(limit if limit is not None else self.room(prompt), body.engine_logprobs)
        fmt = ChatFormat(self.tokenizer.decode)
        return await self.generate(request, prompt, params, fmt, body.stream, body.include_usage)

    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        self.check(body.model, "/v1/embeddings")
        vectors, tokens = await self.aeng.embed(texts_of(body.input), pooling=body.pooling)
        data = [{"object": "embedding", "index": i, "embedding": _vector(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def translations(self, body: TranslationRequest) -> dict[str, Any]:
        self.check(body.model, "/v1/translations")
        body.check()
        try:
            texts, prompt_tokens, completion_tokens = await self.aeng.translate(
                texts_of(body.input), beam_size=body.beam_size, max_tokens=body.max_tokens)
        except UsageError as e:  # the engine calls a source its prompt; here it is the input
            message = str(e)
            raise UsageError("input" + message[len("prompt"):] if message.startswith("prompt:") else message) from None
        return {"id": f"trans-{uuid.uuid4().hex}", "object": "translation", "created": now(),
                "model": self.model_name, "data": [{"index": i, "text": t} for i, t in enumerate(texts)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model(self, model: str) -> dict[str, Any]:
        self.check(model, ARCH_ROUTE[self.engine.arch])
        return self._card()

    async def health(self) -> dict[str, str]:
        if not self.aeng.alive:  # the engine's thread stopped: an error, or shut down
            raise ApiError(503, f"the engine is not running: {self.aeng.error or 'stopped'}", code="engine_stopped")
        return {"status": "ok"}

    async def scrape(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- shared ---

    def check(self, model: str | None, route: str) -> None:
        """The request names this model (or none) and the model's kind serves the route."""
        if model not in (None, "", self.model_name):
            raise ApiError(404, f"model: {model!r} is not served here; expected {self.model_name!r}",
                           param="model", code="model_not_found")
        needs, arch = ROUTE_ARCH[route], self.engine.arch
        if arch != needs:
            raise ApiError(400, f"model: {self.model_name!r} is {_a(arch)}; {route} needs {_a(needs)} "
                           f"(this model serves {ARCH_ROUTE[arch]})", param="model", code="wrong_model_kind")

    def room(self, prompt_ids: list[int]) -> int:
        """The default ``max_tokens``: what the context leaves after the prompt (at least 1,
        so that a prompt too long gets the engine's one refusal naming it)."""
        return max(1, self.engine.max_context - len(prompt_ids))

    def _card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "blockformer",
                "max_model_len": self.engine.max_context}

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
        """The engine's next output. Its failing, or its thread stopped, is a 5xx with the
        engine's own message (not a traceback)."""
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

    def _logprobs(self, pieces):
        return self.fmt.logprobs(pieces or []) if self.want_logprobs else None

    async def collect(self, out, request: Request) -> Response:
        """The whole completion as one JSON body; a client gone meanwhile aborts it."""
        text, pieces = [out.text], list(out.logprobs or [])
        try:
            while not out.finished:
                if await request.is_disconnected():
                    return Response(status_code=499)  # nginx's "client closed request"; no one reads it
                out = await self.next()
                text.append(out.text)
                pieces.extend(out.logprobs or [])
            self.reason = out.finish_reason or "stop"
        finally:
            await self.close()
        choice = self.fmt.choice("".join(text), self._logprobs(pieces), self.reason)
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
                    yield _sse(self._envelope(chunk, [self.fmt.delta(out.text, self._logprobs(out.logprobs), None)]))
                out = await self.next()
            self.reason = out.finish_reason or "stop"
            yield _sse(self._envelope(chunk, [self.fmt.delta(out.text, self._logprobs(out.logprobs), self.reason)]))
            if include_usage:
                yield _sse(self._envelope(chunk, [], usage=usage(out)))
        except ApiError as e:
            yield _sse(e.body())
        finally:
            await self.close()
        yield "data: [DONE]\n\n"


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
    """``aclose``, shielded from the cancellation that may be what is closing it."""
    with anyio.CancelScope(shield=True):
        await agen.aclose()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def _vector(values: list[float], encoding: str) -> list[float] | str:
    """OpenAI's ``base64`` is the float32 little-endian bytes (its Python client's default)."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def _a(arch: str) -> str:
    return ("an " if arch[0] in "aeiou" else "a ") + arch
