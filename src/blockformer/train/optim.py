"""AdamW with decoupled weight decay (Loshchilov & Hutter 2019), applied only to matrices.

Norm gains and biases set scale and offset, not capacity, and embedding rows are updated
only when their token appears; decaying any of them pulls them to zero for no gain
(nanoGPT, minGPT). So: decay 2-D weights of linear layers, nothing else. A tied output
head shares its matrix with the token embedding and is therefore not decayed either.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
    """AdamW over ``param_groups``, as one fused kernel over all parameters where torch has
    one for the device (CUDA; CPU since torch 2.4), else the multi-tensor (foreach) path.
    Neither waits for the device during a step. ``lr_scale``: a parameter name's multiplier
    of ``cfg.lr`` (fine-tuning)."""
    params = list(model.parameters())
    groups = param_groups(model, cfg.weight_decay, lr_scale, cfg.lr)
    kind = {"fused": True} if fused_available(params[0].device) else {"foreach": True}
    # DTensor parameters (FSDP2, TP) take the same kernels: torch 2.13 runs _fused_adamw_
    # and the _foreach_ ops on DTensors shard by shard, whatever their mesh (FSDP x TP mixes
    # 1-D and 2-D) or placements, and on CPU/gloo the weights equal the per-tensor path's
    # (foreach: bit for bit; fused: to 1e-8; tests/test_parallel_comm.py). Not everywhere:
    # a group mixing plain tensors with DTensors (an MoE FFN that TP leaves whole) takes the
    # per-tensor path, as both kernels refuse it ("got mixed torch.Tensor and DTensor"), and
    # fp16 takes foreach, as its GradScaler hands the fused kernel a plain found_inf tensor.
    if any(isinstance(p, DTensor) for p in params):
        if any(len({isinstance(p, DTensor) for p in g["params"]}) > 1 for g in groups):
            kind = {"foreach": False}
        elif cfg.precision == "fp16":
            kind = {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kind)


def fused_available(device: torch.device) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` runs on ``device`` with this torch."""
    if device.type == "cuda":
        return True
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return device.type == "cpu" and version >= (2, 4)


@contextlib.contextmanager
def kernel_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Loading an optimizer state dict restores its param groups' ``fused``/``foreach``
    flags; the kernel stays this run's choice (another layout may have written the state)."""
    flags = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
    yield
    for group, kept in zip(optimizer.param_groups, flags):
        group.update(kept)
