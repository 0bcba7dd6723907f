"""Encoder-only model: full visibility, every position sees every other (BERT's shape)."""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..nn.stack import Stack
from .base import TransformerModel, default_positions
from .checks import check_ids, check_mask, check_positions
from .embedding import Embedding


class EncoderModel(TransformerModel):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg, cfg.vocab_size)
        self.encoder = Stack(cfg, cfg.n_layers, causal=False)
        self.head = self._make_head(self.embed.tokens)
        self._init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab). ``attention_mask`` (B, T): True for real
        tokens; padded keys are hidden from every query."""
        check_ids(tokens, self.cfg.vocab_size)
        check_mask(attention_mask, tokens, "attention_mask")
        check_positions(self.cfg, tokens, positions)
        positions = default_positions(tokens, None) if positions is None else positions
        h = self.encoder(self.embed(tokens, positions), positions, attention_mask)
        return self.head(h)
