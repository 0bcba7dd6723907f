"""Tokens to vectors: a token embedding, plus an absolute position signal if one is used,
plus BERT's segment embedding (``n_token_types``) when the model has that table."""

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
        # BERT's segment table: segment 0 everywhere unless segment ids are given (a text pair: 0, then 1).
        self.token_types = nn.Embedding(cfg.n_token_types, cfg.d_model) if cfg.n_token_types else None
        self.norm = build_norm(cfg) if cfg.embedding_norm else None  # BERT, BART
        self.dropout = Dropout(cfg.dropout)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens, positions and segment ids ``token_types`` (B, T; None: all 0) -> (B, T, d_model)."""
        x = self.tokens(tokens)  # (B, T, d_model)
        if self.scale != 1.0:
            x = x * self.scale
        if self.position is not None:
            x = x + self.position(positions)
        if self.token_types is not None:
            x = x + (self.token_types.weight[0] if token_types is None else self.token_types(token_types))
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def reads_token_types(cfg: TransformerConfig) -> bool:
    """Whether a model of ``cfg`` takes segment ids: a text encoder with a segment table."""
    return cfg.arch == "encoder" and cfg.input == "tokens" and cfg.n_token_types > 0
