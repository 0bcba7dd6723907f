"""Learning-rate schedules as multipliers of ``train.lr`` (a ``LambdaLR`` factor per step).

Steps count from 1 for the first optimizer update, so the first update already has a
non-zero rate.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch

from ..run_config import TrainConfig


def noam(step: int, *, d_model: int, warmup: int) -> float:
    """``d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)`` (Vaswani et al. 2017, eq. 3):
    linear warmup for ``warmup`` steps, then decay with the inverse square root of the step."""
    step = max(step, 1)
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cosine(step: int, *, warmup: int, total: int, floor: float) -> float:
    """Linear warmup to 1, then a half cosine from 1 down to ``floor`` at ``total`` steps
    (Loshchilov & Hutter 2017, without restarts); ``floor`` after that."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step >= total:
        return floor
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant(step: int, *, warmup: int) -> float:
    """1, after an optional linear warmup."""
    return (step + 1) / (warmup + 1) if step < warmup else 1.0


def lr_lambda(cfg: TrainConfig, d_model: int) -> Callable[[int], float]:
    """The multiplier for optimizer step ``i`` (``LambdaLR`` calls it with 0, 1, 2, ...)."""
    if cfg.schedule == "noam":
        return lambda i: noam(i + 1, d_model=d_model, warmup=cfg.warmup)
    if cfg.schedule == "cosine":
        return partial(cosine, warmup=cfg.warmup, total=cfg.steps, floor=cfg.min_lr / cfg.lr)
    return partial(constant, warmup=cfg.warmup)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, d_model: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, d_model))


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Resume the saved schedule's position with this run's rates: the optimizer's and the
    scheduler's saved states both carry the old ``train.lr``, so without this a ``--resume
    --set train.lr=...`` (or another schedule) would be accepted and silently ignored. With
    the config unchanged the rates come out bit-identical to the saved ones."""
    configured = list(scheduler.base_lrs)  # this run's train.lr, times each group's scale
    scheduler.load_state_dict(state)
    scheduler.base_lrs = configured
    step = scheduler.last_epoch
    for group, base, factor in zip(scheduler.optimizer.param_groups, configured, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
