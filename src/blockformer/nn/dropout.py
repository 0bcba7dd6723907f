"""Dropout (Srivastava et al. 2014) whose mask is cheap to draw on a CPU.

torch's CPU dropout draws one Bernoulli sample per element, a large share of a CPU training
step. Here the keep mask is cut from 64-bit random words, 16 bits per element, so one draw
of the generator serves four elements (the figures: BENCHMARKS.md, "Kernel choices").
``p`` is resolved to 1/65536 and the kept values are scaled by the exact inverse of the
resulting keep rate, so the expectation is unchanged. The draws come from torch's
generator, so ``torch.manual_seed`` and a restored RNG state reproduce the masks; inside
``generator(g)`` they come from ``g`` instead, on that thread only (a shard of rows on its
own thread: ``parallel.threads``).

On other devices, for a DTensor, and under ``torch.compile`` (which generates its own masks
inside the fused kernel), this is ``F.dropout`` (``kernels.cheap_dropout`` decides).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels

_LEVELS = 1 << 16
# the generator this thread's masks come from; None: torch's default one
_GENERATOR: contextvars.ContextVar[torch.Generator | None] = contextvars.ContextVar("blockformer_dropout", default=None)


@contextlib.contextmanager
def generator(g: torch.Generator) -> Iterator[None]:
    """Draw this thread's dropout masks from ``g`` inside the block."""
    token = _GENERATOR.set(g)
    try:
        yield
    finally:
        _GENERATOR.reset(token)


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """A bool mask, True with probability ``1 - p`` (to 1/65536), and the keep rate it uses."""
    n = math.prod(shape)
    drop_levels = round(p * _LEVELS)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), None,
                                                                               generator=_GENERATOR.get())
    bits = words.view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]
    return bits >= drop_levels - _LEVELS // 2, 1.0 - drop_levels / _LEVELS


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``."""
    if not training or p == 0.0:
        return x
    if p >= 1.0 or not kernels.cheap_dropout(x):
        return F.dropout(x, p, True)  # a DTensor keeps its own, shard-aware random streams
    keep, rate = keep_mask(x.shape, p, x.device)
    return x * keep * (1.0 / rate)  # autograd keeps the 1-byte mask for the backward


class Dropout(nn.Dropout):
    """``nn.Dropout`` with the cheaper CPU mask; same ``p``, same repr, no state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
