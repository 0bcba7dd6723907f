"""From next-token logits to a token: temperature, top-k, top-p, and a sync-free draw.

The filters follow the usual order (Hugging Face's): temperature scales the logits, top-k
keeps the k largest, top-p (nucleus sampling, Holtzman et al. 2020) keeps the smallest set
of most likely tokens whose probability reaches p. Filtered logits become ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..models.checks import check_int, check_real, kind_of


# Below this, logits / temperature overflow float32 (a logit of 10 over 1e-38 is inf) and
# the probabilities become NaN: a silent draw from nothing. 1e-4 already samples as greedy.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class Sampling:
    """How to choose each token. ``temperature == 0`` or ``do_sample=False`` is greedy."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool = True

    def __post_init__(self) -> None:
        t = check_real(self.temperature, "temperature")
        if not (t == 0 or MIN_TEMPERATURE <= t < float("inf")):  # also refuses NaN
            raise UsageError(f"temperature: {self.temperature}; expected 0 (greedy) or a finite float >= "
                             f"{MIN_TEMPERATURE:g}")
        if self.top_k is not None:
            check_int(self.top_k, "top_k", 1)
        if self.top_p is not None:
            _check_p(self.top_p, "top_p")
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample: {self.do_sample!r}; expected True or False")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """``process_logits`` without its checks (these fields were checked when made):
        what a decode loop calls each step."""
        logits = logits.float()
        if self.greedy:
            return logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k is not None:
            logits = _top_k(logits, self.top_k)
        if self.top_p is not None:
            logits = _top_p(logits, self.top_p)
        return logits

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``choose`` without its checks: next tokens (B,) from logits (B, V), each step."""
        logits = self.process(logits)
        if self.greedy:
            return logits.argmax(dim=-1)
        return sample(logits.softmax(dim=-1), generator)


def _check_p(p: object, name: str) -> None:
    if not 0.0 < check_real(p, name) <= 1.0:  # also refuses NaN
        raise UsageError(f"{name}: {p}; expected a float in (0, 1]")


def _check_logits(logits: object) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        what = f"dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else kind_of(logits)
        raise TypeError(f"logits: {what}; expected a float tensor (batch, vocab)")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th are kept too)."""
    _check_logits(logits)
    check_int(k, "k", 1)
    return _top_k(logits, k)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens until their total probability reaches ``p``.

    A token is dropped when the tokens ranked above it already hold at least ``p`` of the
    mass; the most likely token is always kept.
    """
    _check_logits(logits)
    _check_p(p, "p")
    return _top_p(logits, p)


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.float().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V): probability ranked above each token
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on float32 logits (B, V)."""
    _check_logits(logits)
    _check_sampling(sampling)
    return sampling.process(logits)


def _check_sampling(sampling: object) -> None:
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling: {kind_of(sampling)}; expected a Sampling(temperature, top_k, top_p, do_sample)")


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from ``probs`` (B, V), without a device-to-host sync.

    ``argmax(probs / E)`` with ``E ~ Exponential(1)`` picks token i with probability
    ``probs[i]`` (the exponential race; gpt-fast samples this way), unlike
    ``torch.multinomial``, which synchronises with the host.
    """
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        what = f"dtype {probs.dtype}" if isinstance(probs, torch.Tensor) else kind_of(probs)
        raise TypeError(f"probs: {what}; expected a float tensor (batch, vocab) of probabilities")
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)  # an exact 0 would give 0/0 on a filtered token
    return (probs / race).argmax(dim=-1)


def choose(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next tokens (B,) from next-token logits (B, V)."""
    _check_logits(logits)
    _check_sampling(sampling)
    return sampling.choose(logits, generator)
