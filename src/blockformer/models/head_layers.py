"""Optional layers around the output head that published encoders carry (BERT).

``HeadTransform``: dense + activation + norm between the last hidden state and the output
projection (BERT's masked-LM head). ``Pooler``: dense + tanh on the first position, BERT's
sentence vector (Devlin et al. 2019).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TransformerConfig
from ..nn.feedforward import activation
from ..nn.norm import build_norm


class HeadTransform(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.act = activation(cfg)
        self.norm = build_norm(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(h)))


class Pooler(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> (B, d_model): the first position, projected and squashed."""
        return torch.tanh(self.dense(h[:, 0]))
