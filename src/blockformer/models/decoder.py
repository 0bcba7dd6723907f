"""Decoder-only model: causal, each position sees only its prefix (GPT's shape)."""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..nn.kv_cache import KVCache
from ..nn.stack import Stack
from .base import TransformerModel, default_positions
from .checks import check_cache, check_ids, check_mask, check_positions
from .embedding import Embedding


class DecoderModel(TransformerModel):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg, cfg.vocab_size)
        self.decoder = Stack(cfg, cfg.n_layers, causal=True)
        self.head = self._make_head(self.embed.tokens)
        self._init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab); with ``targets`` (B, T), the summed
        cross-entropy against them instead (padding, id 0, excluded), the logits never whole.

        ``positions`` (B, T): position ids (default 0..T-1, or ``cache_pos``); left-padded
        batches pass each row's true positions. ``attention_mask`` (B, T): True for real
        tokens. With ``cache``, the tokens are written into slots ``cache_pos`` (T,) and
        attend to every earlier slot.
        """
        h = self.hidden_states(tokens, positions=positions, attention_mask=attention_mask, cache=cache,
                               cache_pos=cache_pos)
        return self._logits(h, targets, label_smoothing)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> the last block's hidden states (B, T, d_model), before the LM
        head: what a task head reads."""
        check_ids(tokens, self.cfg.vocab_size, values=cache is None)  # cached steps: checked by their caller
        if cache is not None:
            check_cache(cache, cache_pos, tokens)
        check_mask(attention_mask, tokens, "attention_mask")
        if cache is None:
            check_positions(self.cfg, tokens, positions)
        positions = default_positions(tokens, cache_pos) if positions is None else positions
        return self.decoder(self.embed(tokens, positions), positions, attention_mask, cache=cache, cache_pos=cache_pos)
