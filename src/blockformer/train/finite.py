"""The divergence guard's checks: a kept checkpoint is always finite.

A finite loss and gradient can still give non-finite weights (an lr so large the update
overflows) or finite weights that overflow in the forward pass, so the loop checks the
weights at each evaluation, before anything is saved, and with ``train.nonfinite="skip"``
goes back to the last finite checkpoint (``restore_finite``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .load import load_trainer_state, load_weights
from .optim import kernel_kept


def finite_weights(params: list[torch.nn.Parameter], runtime: Any = None) -> bool:
    """Whether every weight in ``params`` is finite, on every rank. One fused 2-norm per
    tensor (NaN and inf reach it) and one host read; a tensor whose norm overflows, which
    finite values past 1e19 also do, is then checked element by element. ``runtime``
    (``parallel.start``'s) makes every rank agree."""
    local = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params]
    norms = torch.stack(torch._foreach_norm(local)) if local else torch.zeros(1)
    suspects = (~norms.isfinite()).nonzero().flatten().tolist()  # nearly always empty
    bad = any(not bool(torch.isfinite(local[i]).all()) for i in suspects)
    if runtime is not None:
        bad = runtime.any_rank(bad)  # every rank holds other weights; all must agree
    return not bad


def restore_finite(model, optimizer, scaler, params, good: Path | None, initial, device) -> None:
    """``train.nonfinite="skip"``: the weights, optimizer and scaler state of checkpoint
    ``good``; without one, the run's ``initial`` weights and a fresh optimizer state."""
    if good is None:
        with torch.no_grad():
            for p, saved in zip(params, initial):
                p.copy_(saved)
        optimizer.state.clear()  # AdamW starts again: no moments, step 0
        return
    load_weights(model, good, device)
    state = load_trainer_state(good)
    with kernel_kept(optimizer):
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        else:  # written by a parallel run: its moments are sharded elsewhere
            optimizer.state.clear()
    scaler.load_state_dict(state["scaler"])


def diverged_message(what: str, step: int, tc, good: Path | None, parallel_run: bool) -> str:
    """The NonFiniteLoss message: what went non-finite, why it can, where to go back to."""
    how = ("an update overflowed while the loss and gradients were finite" if what == "the weights"
           else "the weights are finite but overflow in the forward pass")
    stuck = parallel_run and tc.nonfinite == "skip"
    why = " (a parallel run cannot go back to it: it stops)" if stuck else ""
    then = "then resume from it" if good else "then start again"
    skip = "" if tc.nonfinite == "skip" else ", or set train.nonfinite=skip to go back to it and carry on"
    return (f"train: {what} became NaN or infinite by step {step} ({how}); nothing was saved at this step. "
            f"Last finite checkpoint: {good or 'none'}{why}. Expected finite weights: lower train.lr "
            f"(now {tc.lr:g}) or raise train.warmup, {then}{skip}")
