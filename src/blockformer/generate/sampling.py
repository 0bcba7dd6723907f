"""From next-token logits to a token: temperature, top-k, top-p, and a sync-free draw.

The filters follow the usual order (Hugging Face's): temperature scales the logits, top-k
keeps the k largest, top-p (nucleus sampling, Holtzman et al. 2020) keeps the smallest set
of most likely tokens whose probability reaches p. Filtered logits become ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError


@dataclass(frozen=True)
class Sampling:
    """How to choose each token. ``temperature == 0`` or ``do_sample=False`` is greedy."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise UsageError(f"temperature: {self.temperature}; expected a finite float >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"top_k: {self.top_k}; expected an integer >= 1 or None")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"top_p: {self.top_p}; expected a float in (0, 1] or None")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th are kept too)."""
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens until their total probability reaches ``p``.

    A token is dropped when the tokens ranked above it already hold at least ``p`` of the
    mass; the most likely token is always kept.
    """
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
    logits = logits.float()
    if sampling.greedy:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k is not None:
        logits = top_k_filter(logits, sampling.top_k)
    if sampling.top_p is not None:
        logits = top_p_filter(logits, sampling.top_p)
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from ``probs`` (B, V), without a device-to-host sync.

    ``argmax(probs / E)`` with ``E ~ Exponential(1)`` picks token i with probability
    ``probs[i]`` (the exponential race; gpt-fast samples this way), unlike
    ``torch.multinomial``, which synchronises with the host.
    """
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)  # an exact 0 would give 0/0 on a filtered token
    return (probs / race).argmax(dim=-1)


def choose(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next tokens (B,) from next-token logits (B, V)."""
    logits = process_logits(logits, sampling)
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample(logits.softmax(dim=-1), generator)
