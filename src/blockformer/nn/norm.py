"""Normalisation: keeps the scale of the residual stream under control."""

from __future__ import annotations

from torch import nn

from ..config import TransformerConfig


def build_norm(cfg: TransformerConfig) -> nn.Module:
    """LayerNorm (Ba et al. 2016), RMSNorm (Zhang & Sennrich 2019) or nothing."""
    if cfg.norm == "layer":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.norm_bias)
    if cfg.norm == "rms":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.Identity()
