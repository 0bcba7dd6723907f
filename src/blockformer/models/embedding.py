"""Tokens to vectors: a token embedding, plus an absolute position signal if one is used."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ADDITIVE_POSITIONS, TransformerConfig
from ..nn.dropout import Dropout
from ..nn.norm import build_norm
from ..nn.position import AbsolutePosition


class Embedding(nn.Module):
    def __init__(self, cfg: TransformerConfig, vocab_size: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.position = AbsolutePosition(cfg) if cfg.position in ADDITIVE_POSITIONS else None
        # BERT's segment table: every position is segment 0 (single-sequence input).
        self.token_types = nn.Embedding(cfg.n_token_types, cfg.d_model) if cfg.n_token_types else None
        self.norm = build_norm(cfg) if cfg.embedding_norm else None  # BERT, BART
        self.dropout = Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)  # (B, T, d_model)
        if self.scale != 1.0:
            x = x * self.scale
        if self.position is not None:
            x = x + self.position(positions)
        if self.token_types is not None:
            x = x + self.token_types.weight[0]
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)
