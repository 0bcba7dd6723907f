"""Encoder-only model: full visibility, every position sees every other (BERT's shape)."""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..nn.stack import Stack
from .base import TransformerModel, default_positions
from .checks import check_ids, check_mask, check_positions
from .embedding import Embedding
from .head_layers import Pooler


class EncoderModel(TransformerModel):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg, cfg.vocab_size)
        self.encoder = Stack(cfg, cfg.n_layers, causal=False)
        self.head = self._make_head(self.embed.tokens)
        self.pooler = Pooler(cfg) if cfg.pooler else None
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
        return self._logits(self.hidden_states(tokens, attention_mask=attention_mask, positions=positions))

    def hidden_states(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> the last block's output (B, T, d_model): features for pooling and
        for a task head."""
        check_ids(tokens, self.cfg.vocab_size)
        check_mask(attention_mask, tokens, "attention_mask")
        check_positions(self.cfg, tokens, positions)
        positions = default_positions(tokens, None) if positions is None else positions
        return self.encoder(self.embed(tokens, positions), positions, attention_mask)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's sentence vector from ``hidden_states`` (B, T, d_model) -> (B, d_model)."""
        if self.pooler is None:
            raise ValueError("pool: this model has no pooler; expected a config with pooler=true")
        return self.pooler(hidden)
