"""Ragged id lists to padded tensors, and the position ids a mask implies.

Decoder-only prompts are padded on the LEFT so that every row's last token sits in the
last column and new tokens are appended in lockstep; each row then counts its positions
from its own first real token, so position signals see ``0, 1, 2, ...`` whatever the
padding. Sources for an encoder are padded on the right (their order does not matter to
the batch, only the mask). ``prepare_prompts`` is the one way every decoding loop (and a
serving engine) turns prompts or sources into a checked ``PromptBatch``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import torch

from ..errors import UsageError
from ..schema import kind_of
from ..tokenizers.base import BOS_ID, EOS_ID, PAD_ID  # the special ids every tokenizer shares

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "PromptBatch", "pad_batch", "positions_from_mask", "prepare_prompts"]


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


@dataclass(frozen=True)
class PromptBatch:
    """A checked batch of token ids on its device, padded on the left (prompts) or on the
    right (sources)."""

    tokens: torch.Tensor  # (B, T) long
    mask: torch.Tensor  # (B, T) bool, True = real token

    @property
    def positions(self) -> torch.Tensor:
        """(B, T): each row counted from its own first real token."""
        return positions_from_mask(self.mask)

    @property
    def lengths(self) -> torch.Tensor:
        """(B,): the real tokens of each row."""
        return self.mask.sum(dim=1)


def prepare_prompts(
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    left: bool = True,
    pad_id: int = PAD_ID,
    vocab_size: int | None = None,
    device: torch.device | str | None = None,
    name: str = "prompts",
    mask_name: str = "attention_mask",
) -> PromptBatch:
    """Id lists (padded here) or a (B, T) integer tensor with an optional mask -> a
    ``PromptBatch`` on ``device``. A left-padded tensor's mask must pad on the left; with
    ``vocab_size`` every real id must be below it. ``name`` and ``mask_name`` are what
    error messages call the two arguments."""
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{mask_name}: {kind_of(attention_mask)}; expected a bool tensor (batch, length)")
    if isinstance(prompts, torch.Tensor):
        batch = _tensor_batch(prompts, attention_mask, left, device, name, mask_name)
    elif attention_mask is not None:
        raise UsageError(f"{mask_name}: only with a tensor of {name}; lists are padded here")
    else:
        batch = PromptBatch(*pad_batch(prompts, left=left, pad_id=pad_id, name=name, device=device))
    if vocab_size is not None:
        _check_ids(batch, vocab_size, name)
    return batch


def _tensor_batch(tokens, mask, left: bool, device, name: str, mask_name: str) -> PromptBatch:
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise UsageError(f"{name}: dtype {tokens.dtype}; expected integer token ids (torch.long)")
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise UsageError(f"{name}: shape {tuple(tokens.shape)}; expected a (batch, length) tensor, length >= 1")
    tokens = tokens.to(device=device, dtype=torch.long)
    if mask is None:
        return PromptBatch(tokens, torch.ones_like(tokens, dtype=torch.bool))
    mask = mask.to(device=device, dtype=torch.bool)
    if mask.shape != tokens.shape:
        raise UsageError(f"{mask_name}: shape {tuple(mask.shape)}; expected {tuple(tokens.shape)} like {name}")
    if left and (not bool((mask[:, 1:] >= mask[:, :-1]).all()) or not bool(mask[:, -1].all())):
        raise UsageError(f"{mask_name}: expected left padding (False then True in each row, >= 1 real token)")
    return PromptBatch(tokens, mask)


def _check_ids(batch: PromptBatch, vocab_size: int, name: str) -> None:
    """Once per call: every real token is an id the model knows."""
    real = batch.tokens[batch.mask]
    if real.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(real))
    if low < 0 or high >= vocab_size:
        raise UsageError(f"{name}: id {low if low < 0 else high} is outside [0, {vocab_size}); expected "
                         f"ids the model knows (below vocab_size={vocab_size})")
