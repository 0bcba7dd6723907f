"""The position-wise feed-forward network: the same two-layer MLP at every position."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GATED_FFNS, TransformerConfig
from .gelu import gelu

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": gelu,  # F.gelu, or in fp32 training a kernel that keeps its derivative (nn/gelu.py)
    "silu": F.silu,
    "swiglu": F.silu,  # Shazeer 2020: SiLU(x W) * (x V)
    "geglu": gelu,  # Shazeer 2020: GELU(x W) * (x V)
}


def activation(cfg: TransformerConfig):
    """The FFN's nonlinearity; ``gelu_approximate="tanh"`` selects GELU's tanh form (GPT-2)."""
    if cfg.ffn in ("gelu", "geglu") and cfg.gelu_approximate == "tanh":
        return _gelu_tanh
    return ACTIVATIONS[cfg.ffn]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return gelu(x, approximate="tanh")  # F.gelu's tanh form, or in fp32 training the kernel's


class FeedForward(nn.Module):
    """``down(act(up(x)))``, or for the gated variants ``down(act(gate(x)) * up(x))``.

    The gated variants fuse ``gate`` and ``up`` into one matmul of width ``2 * d_ff``.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gated = cfg.ffn in GATED_FFNS
        self.act = activation(cfg)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff * (2 if self.gated else 1), bias=cfg.bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # (B, T, d_ff) or (B, T, 2 * d_ff)
        if self.gated:
            gate, h = h.chunk(2, dim=-1)
            return self.down(self.act(gate) * h)
        return self.down(self.act(h))
