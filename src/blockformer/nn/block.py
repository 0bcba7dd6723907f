"""The standard Transformer block: attention across positions, an FFN at each position,
each wrapped in a residual connection and a norm, stacked N times.

Pre-Norm (GPT-2 and most modern models)::

    r = x + Attn(Norm(x));   y = r + FFN(Norm(r))

Post-Norm (the original, Vaswani et al. 2017)::

    r = Norm(x + Attn(x));   y = Norm(r + FFN(r))

A decoder block of an encoder-decoder adds cross-attention to the encoder output between
the two. The sublayers are plain attributes (``attn``, ``cross_attn``, ``ffn``) that a
caller may replace; each is called as ``attn(h, ctx)`` / ``ffn(h)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TransformerConfig
from .attention import Attention, AttnInputs
from .dropout import Dropout
from .feedforward import FeedForward
from .moe import MoEFeedForward
from .norm import build_norm
from .residual import Residual


class Block(nn.Module):
    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        causal: bool | None = None,
        cross: bool = False,
        layer_idx: int = 0,
        n_layers: int | None = None,
    ) -> None:
        """``causal`` defaults to the config's architecture; ``n_layers`` is the depth of
        the stack this block sits in (for depth-derived residual scales)."""
        super().__init__()
        n_layers = n_layers or cfg.n_layers
        self.causal = cfg.arch == "decoder" if causal is None else causal
        self.pre_norm = cfg.norm_position == "pre"
        self.attn = Attention(cfg, layer_idx)
        self.attn_norm = build_norm(cfg)
        self.attn_residual = Residual(cfg, n_layers)
        if cross:
            self.cross_attn = Attention(cfg, layer_idx, cross=True)
            self.cross_norm = build_norm(cfg)
            self.cross_residual = Residual(cfg, n_layers)
        else:
            self.cross_attn = None
        self.ffn = MoEFeedForward(cfg) if cfg.ffn_experts else FeedForward(cfg)
        self.ffn_norm = build_norm(cfg)
        self.ffn_residual = Residual(cfg, n_layers)
        self.dropout = Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, ctx: AttnInputs | None = None, cross_ctx: AttnInputs | None = None
    ) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, d_model). Without ``ctx`` the block applies only its own
        causal mask; position signals inside attention (rope, alibi, relative) come from
        the stack that owns the block."""
        ctx = AttnInputs(is_causal=self.causal) if ctx is None else ctx
        x = self._sublayer(x, self.attn_norm, self.attn_residual, lambda h: self.attn(h, ctx))
        if self.cross_attn is not None:
            x = self._sublayer(x, self.cross_norm, self.cross_residual, lambda h: self.cross_attn(h, cross_ctx))
        ffn = self.ffn
        if isinstance(ffn, MoEFeedForward) and ctx.valid is not None:
            ffn = lambda h: self.ffn(h, ctx.valid)  # noqa: E731 - padding is routed nowhere
        return self._sublayer(x, self.ffn_norm, self.ffn_residual, ffn)

    def _sublayer(self, x, norm, residual, f) -> torch.Tensor:
        if self.pre_norm:
            return residual(x, self.dropout(f(norm(x))))
        return norm(residual(x, self.dropout(f(x))))
