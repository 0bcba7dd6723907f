"""Masked-language-model corruption (BERT, Devlin et al. 2019).

A share ``mask_rate`` of the positions is selected (15%); of those, ``mask_token_rate``
(80%) become the mask token, ``random_token_rate`` (10%) a random ordinary token, and the
rest keep their token. The model is scored only at the selected positions: the targets are
the original tokens there and padding (ignored by the loss) everywhere else. Keeping and
randomising some selected tokens means the model cannot learn that only masked positions
matter.

The mask token is ``<unk>`` (id 3): the byte and byte-level BPE tokenizers never produce
it, so it is free, and the vocabulary (and every tokenizer file) stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tokenizers.base import NUM_SPECIALS, PAD_ID, UNK_ID

MASK_ID = UNK_ID


@dataclass(frozen=True)
class MaskingRates:
    mask_rate: float = 0.15
    mask_token_rate: float = 0.8
    random_token_rate: float = 0.1


def mask_tokens(
    tokens: torch.Tensor,
    vocab_size: int,
    rates: MaskingRates,
    generator: torch.Generator,
    *,
    maskable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, T) -> (corrupted inputs (B, T), targets (B, T): the original token where
    selected, ``PAD_ID`` elsewhere). ``maskable`` (B, T): positions that may be selected
    (default: every non-special token). Draws come from ``generator`` (CPU)."""
    if maskable is None:
        maskable = tokens >= NUM_SPECIALS
    shape = tokens.shape
    u_select = torch.rand(shape, generator=generator)
    u_kind = torch.rand(shape, generator=generator)
    random_ids = torch.randint(NUM_SPECIALS, vocab_size, shape, generator=generator)
    device = tokens.device
    selected = (u_select.to(device) < rates.mask_rate) & maskable
    to_mask = selected & (u_kind.to(device) < rates.mask_token_rate)
    to_random = selected & ~to_mask & (u_kind.to(device) < rates.mask_token_rate + rates.random_token_rate)
    inputs = torch.where(to_mask, torch.full_like(tokens, MASK_ID), tokens)
    inputs = torch.where(to_random, random_ids.to(device), inputs)
    targets = torch.where(selected, tokens, torch.full_like(tokens, PAD_ID))
    return inputs, targets
