"""The OpenAI wire format: request bodies as pydantic models, responses as plain dicts.

Requests are strict (a string is not a number, ``true`` is not 1) and refuse unknown fields,
so a typo is a 400 naming it rather than a setting silently ignored. The sampling fields map
one to one onto ``SamplingParams``, which checks their ranges. Responses follow OpenAI's
shapes (``text_completion``, ``chat.completion``, their ``.chunk`` stream pieces,
``usage`` with ``prompt_tokens_details.cached_tokens``) so its clients read them unchanged.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import UsageError
from .params import MAX_LOGPROBS, RequestOutput, SamplingParams, TokenLogprob


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    user: str | None = None  # OpenAI's clients may send it; it changes nothing here


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Sampling(_Body):
    """The fields both generation routes share. ``None`` means the default, as in vLLM."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's settings; a value out of range raises a ``UsageError`` naming it."""
        if self.n not in (None, 1):
            raise UsageError(f"n: {self.n}; only n=1 is served (one choice per request)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise UsageError(f"{name}: {getattr(self, name)}; penalties are not supported, expected 0")
        if self.stream_options is not None and not self.stream:
            raise UsageError("stream_options: given without stream=true; expected stream=true with it")
        given = {k: v for k, v in {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
        }.items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default; null: up to the model's context
    logprobs: int | None = None
    echo: bool = False

    def check(self) -> None:
        if self.echo:
            raise UsageError("echo: true; the prompt is not echoed, expected false")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (``name``, ``tool_calls``) pass through to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts joined, as vLLM does for text-only models
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # default: what the model's context leaves
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    def check(self) -> None:
        if not self.messages:
            raise UsageError("messages: an empty list; expected at least one message")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise UsageError("max_completion_tokens: given with max_tokens; expected one of the two")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise UsageError("top_logprobs: given without logprobs=true; expected logprobs=true with it")
            if isinstance(self.top_logprobs, bool) or not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise UsageError(f"top_logprobs: {self.top_logprobs}; expected an integer in [0, {MAX_LOGPROBS}]")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingRequest(_Body):
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    pooling: str = "mean"


MAX_BEAM = 16  # one request's beams are its own batch, outside the continuous one: keep it small


class TranslationRequest(_Body):
    input: str | list[str]
    beam_size: int = 1
    max_tokens: int | None = None  # default: the source's length + 50, within the context

    def check(self) -> None:
        if not 1 <= self.beam_size <= MAX_BEAM:
            raise UsageError(f"beam_size: {self.beam_size}; expected an integer in [1, {MAX_BEAM}]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UsageError(f"max_tokens: {self.max_tokens}; expected an integer >= 1")


def texts_of(value: str | list[str], name: str = "input") -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise UsageError(f"{name}: an empty list; expected at least one text")
    return texts


# Responses


def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def envelope(request_id: str, obj: str, model: str, created: int, choices: list, **extra) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices, **extra}


class CompletionFormat:
    """Choices of ``/v1/completions``: ``text``, and logprobs as parallel lists with each
    token's character offset from the start of the completion."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, decode) -> None:
        self.decode = decode
        self.offset = 0

    def logprobs(self, pieces: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if pieces is None:
            return None
        tokens = [self.decode([p.token_id]) for p in pieces]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [finite(p.logprob) for p in pieces],
            "top_logprobs": [{self.decode([i]): finite(lp) for i, lp in p.top} for p in pieces],
            "text_offset": offsets,
        }

    def choice(self, text: str, logprobs, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self) -> dict[str, Any] | None:
        return None

    delta = choice


class ChatFormat:
    """Choices of ``/v1/chat/completions``: an assistant ``message`` (``delta`` when
    streamed, the first carrying the role), logprobs as ``content`` entries."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, decode) -> None:
        self.decode = decode

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.decode([token_id])
        return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8"))}

    def logprobs(self, pieces: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if pieces is None:
            return None
        content = []
        for p in pieces:
            entry = self._entry(p.token_id, p.logprob)
            entry["top_logprobs"] = [self._entry(i, lp) for i, lp in p.top]
            content.append(entry)
        return {"content": content}

    def choice(self, text: str, logprobs, finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self) -> dict[str, Any]:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, text: str, logprobs, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def now() -> int:
    return int(time.time())


def finite(logprob: float) -> float:
    """JSON has no -inf: a token sampling had ruled out (top-k, top-p) gets vLLM's -9999."""
    return logprob if math.isfinite(logprob) else -9999.0
