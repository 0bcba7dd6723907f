"""AdamW with decoupled weight decay (Loshchilov & Hutter 2019), applied only to matrices.

Norm gains and biases set scale and offset, not capacity, and embedding rows are updated
only when their token appears; decaying any of them pulls them to zero for no gain
(nanoGPT, minGPT). So: decay 2-D weights of linear layers, nothing else. A tied output
head shares its matrix with the token embedding and is therefore not decayed either.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..run_config import TrainConfig


def param_groups(
    model: nn.Module, weight_decay: float, lr_scale: Callable[[str], float] | None = None, lr: float = 1.0
) -> list[dict]:
    """Two AdamW groups: ``decay`` (2-D matmul weights) and ``no_decay`` (the rest); split
    further by learning rate (``lr * lr_scale(name)``) when ``lr_scale`` is given."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {(True, 1.0): [], (False, 1.0): []}
    # Modules may name more parameters that are not matrices in this sense (stacked expert biases).
    embedding_ids |= {id(p) for m in model.modules() if hasattr(m, "no_weight_decay") for p in m.no_weight_decay()}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        decay = p.dim() >= 2 and id(p) not in embedding_ids
        groups.setdefault((decay, lr_scale(name) if lr_scale else 1.0), []).append(p)
    out = []
    for (decay, scale), params in groups.items():
        group = {"params": params, "weight_decay": weight_decay if decay else 0.0}
        if lr_scale is not None:
            group["lr"] = lr * scale
        if params or scale == 1.0:
            out.append(group)
    return out


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, lr_scale: Callable[[str], float] | None = None
) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; fused on CUDA, where the single kernel is faster.
    ``lr_scale``: a parameter name's multiplier of ``cfg.lr`` (fine-tuning)."""
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay, lr_scale, cfg.lr), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **fused
    )
