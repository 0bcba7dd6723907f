"""AdamW with decoupled weight decay (Loshchilov & Hutter 2019), applied only to matrices.

Norm gains and biases set scale and offset, not capacity, and embedding rows are updated
only when their token appears; decaying any of them pulls them to zero for no gain
(nanoGPT, minGPT). So: decay 2-D weights of linear layers, nothing else. A tied output
head shares its matrix with the token embedding and is therefore not decayed either.
"""

from __future__ import annotations

import torch
from torch import nn

from ..run_config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: ``decay`` (2-D matmul weights) and ``no_decay`` (the rest)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; fused on CUDA, where the single kernel is faster."""
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **fused
    )
