"""Encoder-decoder model: the original Transformer (Vaswani et al. 2017).

The encoder reads the source with full visibility; the decoder reads the target shifted
right, causally, and cross-attends to the encoder's output at every block.
"""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..nn.kv_cache import KVCache
from ..nn.stack import Stack
from .base import TransformerModel, default_positions
from .checks import check_batch, check_cache, check_ids, check_mask, check_memory, check_positions
from .embedding import Embedding
from .inputs import build_input, stack_config


class EncoderDecoderModel(TransformerModel):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tgt_embed = Embedding(cfg, cfg.vocab_size)
        if cfg.input != "tokens":  # the encoder reads patches or frames (models/inputs.py)
            self.src_embed = build_input(cfg)
        elif cfg.src_vocab_size is None and cfg.tie_embeddings:
            self.src_embed = Embedding(cfg, cfg.vocab_size)
            self.src_embed.tokens = self.tgt_embed.tokens  # one shared vocabulary
        else:
            self.src_embed = Embedding(cfg, cfg.src_vocab_size or cfg.vocab_size)
        self.encoder = Stack(stack_config(cfg), cfg.n_encoder_layers, causal=False)
        self.decoder = Stack(cfg, cfg.n_decoder_layers, causal=True, cross=True)
        self.head = self._make_head(self.tgt_embed.tokens)
        self._init_weights()

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """src (B, S) -> memory (B, S, d_model). ``src_mask`` (B, S): True for real tokens.
        With ``input`` patches or frames, ``src`` holds images or frames (the adapter checks
        them) and the memory's mask is ``hidden_mask(src_mask)``."""
        if self.cfg.input != "tokens":
            x, positions, mask = self.src_embed(src, src_mask)
            return self.encoder(x, positions, mask)
        check_ids(src, self.cfg.src_vocab_size or self.cfg.vocab_size, "src")
        check_mask(src_mask, src, "src_mask")
        check_positions(self.cfg, src, None, "src")
        positions = default_positions(src, None)
        return self.encoder(self.src_embed(src, positions), positions, src_mask)

    def hidden_states(self, tokens: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """A task head reads the encoder's output: tokens (B, S) -> (B, S, d_model)."""
        return self.encode(tokens, attention_mask)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor | None,
        src_mask: torch.Tensor | None = None,
        *,
        tgt_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """tgt (B, T) -> logits (B, T, vocab), or with ``targets`` the summed loss. With a
        cache, ``memory`` is needed only on the first call: cross-attention keys and values
        are computed once and kept."""
        if memory is None and cache is None:
            raise ValueError("decode needs the encoder output (memory) or a filled cache")
        check_ids(tgt, self.cfg.vocab_size, "tgt", values=cache is None)
        if cache is not None:
            check_cache(cache, cache_pos, tgt, "tgt")
        check_mask(tgt_mask, tgt, "tgt_mask")
        if memory is not None:
            check_memory(memory, tgt, src_mask, self.cfg.d_model)
        if cache is None:
            check_positions(self.cfg, tgt, positions, "tgt")
        positions = default_positions(tgt, cache_pos) if positions is None else positions
        h = self.decoder(
            self.tgt_embed(tgt, positions), positions, tgt_mask, memory, src_mask, cache=cache, cache_pos=cache_pos
        )
        return self._logits(h, targets, label_smoothing)

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        *,
        src_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """(src (B, S), target shifted right (B, T)) -> logits (B, T, vocab); with
        ``targets`` (B, T), the summed cross-entropy against them instead (padding excluded)."""
        check_ids(tgt, self.cfg.vocab_size, "tgt", values=False)
        if isinstance(src, torch.Tensor) and src.dim() >= 1:
            check_batch(tgt, src.shape[0], "tgt", "src")
        memory = self.encode(src, src_mask)
        return self.decode(tgt, memory, self.hidden_mask(src_mask), tgt_mask=tgt_mask, targets=targets,
                           label_smoothing=label_smoothing)
