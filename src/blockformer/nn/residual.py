"""How a sublayer's output joins the residual stream: ``y = x + F(x)`` and its variants."""

from __future__ import annotations

import torch
from torch import nn

from ..config import TransformerConfig


class Residual(nn.Module):
    """Combine the trunk ``x`` with a branch output ``f``.

    - ``plain``: ``x + f``.
    - ``scaled``: ``alpha * x + f`` (trunk, DeepNet) or ``x + beta * f`` (branch).
    - ``gated``: ``x + g * f`` with a learnable per-channel ``g``, initialised small
      (ReZero, Bachlechner et al. 2020; LayerScale, Touvron et al. 2021).
    - ``none``: ``f`` alone; no skip path (for experiments).
    """

    def __init__(self, cfg: TransformerConfig, n_layers: int) -> None:
        super().__init__()
        self.kind = cfg.residual
        self.on_trunk = cfg.residual_scale_target == "trunk"
        self.scale = cfg.resolved_residual_scale(n_layers) if self.kind == "scaled" else 1.0
        if self.kind == "gated":
            self.gate = nn.Parameter(torch.full((cfg.d_model,), cfg.residual_gate_init))

    def forward(self, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if self.kind == "plain":
            return x + f
        if self.kind == "scaled":
            return self.scale * x + f if self.on_trunk else x + self.scale * f
        if self.kind == "gated":
            return x + self.gate * f
        return f

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}" + (f", scale={self.scale:.4g}" if self.kind == "scaled" else "")
