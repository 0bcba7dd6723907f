"""Ragged id lists to padded tensors, and the position ids a mask implies.

Decoder-only prompts are padded on the LEFT so that every row's last token sits in the
last column and new tokens are appended in lockstep; each row then counts its positions
from its own first real token, so position signals see ``0, 1, 2, ...`` whatever the
padding. Sources for an encoder are padded on the right (their order does not matter to
the batch, only the mask).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

import torch

from ..errors import UsageError
from ..schema import kind_of
from ..tokenizers.base import BOS_ID, EOS_ID, PAD_ID  # the special ids every tokenizer shares

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "pad_batch", "positions_from_mask"]


def pad_batch(
    seqs: Sequence[Sequence[int]],
    *,
    left: bool,
    pad_id: int = PAD_ID,
    name: str = "prompts",
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ``(tokens (B, T) long, mask (B, T) bool, True = real token)``."""
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
        raise UsageError(f"{name}: a {type(seqs).__name__}; expected a list of token-id lists (or a tensor)")
    if len(seqs) == 0:
        raise UsageError(f"{name}: empty batch; expected at least one sequence")
    for i, s in enumerate(seqs):
        if isinstance(s, (str, bytes, int)) or not hasattr(s, "__len__"):
            raise UsageError(f"{name}[{i}]: {s!r}; expected a list of token ids (encode text with the tokenizer)")
        if len(s) == 0:
            raise UsageError(f"{name}[{i}]: empty; expected at least one token id")
        ids = s.tolist() if hasattr(s, "tolist") else s
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_)) for t in ids):
            raise UsageError(f"{name}[{i}]: expected integer token ids")
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        cols = slice(T - len(s), T) if left else slice(0, len(s))
        tokens[i, cols] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, cols] = True
    return tokens.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Each row's position ids, counted from its first real token: ``cumsum(mask) - 1``.

    Padding gets position 0 (never -1, which would index outside a learned table); its
    output is hidden by the mask anyway.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: {kind_of(mask)}; expected a bool tensor (batch, length)")
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
