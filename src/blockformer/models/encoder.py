"""Encoder-only model: full visibility, every position sees every other (BERT's shape)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import TransformerConfig
from ..nn.stack import Stack
from .base import TransformerModel, default_positions
from .checks import check_ids, check_mask, check_positions, check_token_types
from .embedding import Embedding
from .head_layers import Pooler
from .inputs import build_input, stack_config


class EncoderModel(TransformerModel):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.input == "tokens":
            self.embed = Embedding(cfg, cfg.vocab_size)
            self.head = self._make_head(self.embed.tokens)
        else:  # patches or frames: no vocabulary, so no token head (a task head reads the hidden states)
            self.embed, self.head, self.head_transform = build_input(cfg), nn.Identity(), None
        self.encoder = Stack(stack_config(cfg), cfg.n_layers, causal=False)
        self.pooler = Pooler(cfg) if cfg.pooler else None
        self._init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab); with ``targets`` (B, T), the summed
        cross-entropy against them instead (padding, id 0, excluded: a masked LM's unselected
        positions). ``attention_mask`` (B, T): True for real tokens; padded keys are hidden
        from every query. ``token_types`` (B, T): segment ids (see ``hidden_states``). With
        ``input`` patches or frames there is no vocabulary: the hidden states, for a task head
        to read."""
        h = self.hidden_states(tokens, attention_mask=attention_mask, positions=positions, token_types=token_types)
        return self._logits(h, targets, label_smoothing)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> the last block's output (B, T, d_model): features for pooling and
        for a task head. ``token_types`` (B, T): BERT's segment ids, e.g. 0 for ``[CLS] a
        [SEP]`` and 1 for ``b [SEP]`` of a text pair (a model with ``n_token_types``; None:
        all 0). With ``input`` patches or frames, ``tokens`` are the images or frames and
        ``attention_mask`` marks real patches or frames (the adapter checks both)."""
        if self.cfg.input != "tokens":
            check_token_types(self.cfg, tokens, token_types)  # refused if given: no text, no segments
            x, positions, mask = self.embed(tokens, attention_mask)
            return self.encoder(x, positions, mask)
        check_ids(tokens, self.cfg.vocab_size)
        check_mask(attention_mask, tokens, "attention_mask")
        check_positions(self.cfg, tokens, positions)
        check_token_types(self.cfg, tokens, token_types)
        positions = default_positions(tokens, None) if positions is None else positions
        return self.encoder(self.embed(tokens, positions, token_types), positions, attention_mask)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's sentence vector from ``hidden_states`` (B, T, d_model) -> (B, d_model)."""
        if self.pooler is None:
            raise ValueError("pool: this model has no pooler; expected a config with pooler=true")
        return self.pooler(hidden)
