"""What a request asks for and what it gets back: sampling settings and output pieces.

The fields are OpenAI's (and vLLM's ``SamplingParams``): ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``min_tokens``,
``ignore_eos``, ``logprobs``. Each is checked when the request is made; a bad one raises a
``UsageError`` (a ``ValueError``) that names it, which the HTTP layer turns into a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UsageError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1 keep every
    token; ``min_p`` drops tokens less likely than ``min_p`` times the most likely one.
    ``seed`` gives the request its own generator: its tokens are the same alone and in any
    batch. ``logprobs``: None for none, N >= 0 for the chosen token's log-probability and
    the N most likely alternatives at each step."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _int(self.max_tokens, "max_tokens", 1)
        _int(self.min_tokens, "min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            raise UsageError(f"min_tokens: {self.min_tokens} exceeds max_tokens={self.max_tokens}; expected at most that")
        t = _real(self.temperature, "temperature")
        if not (t == 0 or 1e-4 <= t <= 100):
            raise UsageError(f"temperature: {self.temperature}; expected 0 (greedy) or a float in [0.0001, 100]")
        if not 0 < _real(self.top_p, "top_p") <= 1:
            raise UsageError(f"top_p: {self.top_p}; expected a float in (0, 1]")
        if _int(self.top_k, "top_k", -1) == -1:
            object.__setattr__(self, "top_k", 0)
        if not 0 <= _real(self.min_p, "min_p") <= 1:
            raise UsageError(f"min_p: {self.min_p}; expected a float in [0, 1]")
        if self.seed is not None:
            _int(self.seed, "seed", 0)
            if self.seed >= 2**63:
                raise UsageError(f"seed: {self.seed}; expected an integer in [0, 2**63)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise UsageError(f"stop: {len(self.stop)} strings; expected at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise UsageError(f"stop[{i}]: {s!r}; expected a non-empty string")
        for i, t in enumerate(self.stop_token_ids):
            _int(t, f"stop_token_ids[{i}]", 0)
        if not isinstance(self.ignore_eos, bool):
            raise UsageError(f"ignore_eos: {self.ignore_eos!r}; expected true or false")
        if self.logprobs is not None and not 0 <= _int(self.logprobs, "logprobs", 0) <= MAX_LOGPROBS:
            raise UsageError(f"logprobs: {self.logprobs}; expected an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int(value: object, name: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{name}: {value!r}; expected an integer >= {low}")
    if value < low:
        raise UsageError(f"{name}: {value}; expected an integer >= {low}")
    return value


def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{name}: {value!r}; expected a finite number")
    return float(value)


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the ``top`` alternatives (id, logprob),
    most likely first, under the distribution it was drawn from (after temperature)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one engine step made for one request: the new token ids and text since the last
    output (``text`` holds back what may still become a stop string or is a partial
    character), and, once ``finished``, why: "stop" (EOS, a stop string or stop token),
    "length" (``max_tokens`` or the model's context), "abort" (cancelled) or "error"."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    error: str | None = None
