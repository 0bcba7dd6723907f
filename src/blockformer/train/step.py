"""One optimizer update: the micro-batches' losses, backward, clip, the divergence check, AdamW.

Each micro-batch's summed loss is divided by the target tokens of the whole step, so
gradient accumulation weighs by tokens, not by micro-batches. The runtime
(``parallel.start``'s) gives this rank its slice of each batch, the global loss and the
global gradient norm; on one process those are the plain computations. With ``threads``
(``train.batch_threads``), one process splits each micro-batch's rows over CPU threads
(``parallel.threads``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.checks import trusted_inputs
from ..parallel import Local
from ..parallel.fsdp import gradient_sync
from ..parallel.threads import RowThreads
from ..precision import autocast
from .compile import LossFn
from .objective import Objective


def train_step(
    model: torch.nn.Module,
    objective: Objective,
    batches: list[Any],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    params: list[torch.nn.Parameter],
    tc: Any,
    device: torch.device,
    check_finite: bool = False,
    runtime: Any = None,
    *,
    loss_fn: LossFn | None = None,
    norms: list[torch.Tensor] | None = None,
    threads: RowThreads | None = None,
) -> torch.Tensor | None:
    """One optimizer update from ``batches`` (the micro-batches of gradient accumulation);
    returns the mean loss per target token. With ``check_finite``, a NaN or infinite loss or
    gradient norm makes no update: one process with fused AdamW skips it on the device (its
    ``found_inf`` input, as ``GradScaler`` uses it) and the loss comes back non-finite, with
    no host sync; otherwise the host checks and None comes back (fp16: the loss only; its
    scaler skips inf gradients). ``loss_fn`` replaces ``objective.loss`` (the compiled one,
    under ``train.compile``). ``norms`` gets the gradients' global norm before clipping (a
    device tensor: no sync) for the metrics. In a parallel run ``batches`` are global.
    ``threads`` runs each micro-batch's rows on its threads (``RowThreads``)."""
    runtime = runtime or Local(device)
    model.train()
    n_targets = sum(objective.count_targets(b) for b in batches)
    if runtime.pipeline is not None:
        total = runtime.pipeline.step(batches, n_targets, tc)
    else:
        total = _backward(model, objective, batches, n_targets, scaler, tc, device, runtime, loss_fn, threads, params)
    return _update(optimizer, scaler, params, tc, total, n_targets, check_finite, runtime, norms)


def _backward(model, objective, batches, n_targets, scaler, tc, device, runtime, loss_fn, threads, params):
    """Backpropagate each micro-batch's share of the step's loss; returns the summed loss.
    Gradients cross the data-parallel ranks once, in the last micro-batch's backward
    (``parallel.grad_sync = "every"``: in each one's)."""
    split = threads is not None and threads.n > 1  # one process (resolve_batch_threads): no sync, no scaler

    def loss_of(rows: Any) -> torch.Tensor:
        # The run's own tokenizer made these ids (< vocab_size by construction): the models'
        # value checks would read them on the host, a device sync per micro-batch.
        # Both contexts are per thread: each shard enters its own, with no cast shared.
        with autocast(tc.precision, device, cache=not split), trusted_inputs():
            return (loss_fn or objective.loss)(model, rows, tc.label_smoothing)

    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        local = runtime.local_batch(batch)
        if split:
            total += threads.backward(loss_of, local, params, 1.0 / n_targets)
            continue
        sync = i == len(batches) - 1 or runtime.grad_sync == "every"  # parallel.grad_sync
        with gradient_sync(model, sync), runtime.loss_context(tc.label_smoothing):
            loss_sum = loss_of(local)
            scaler.scale(loss_sum * runtime.grad_scale / n_targets).backward()
        total += loss_sum.detach()
    return runtime.loss_total(total)


def _update(optimizer, scaler, params, tc, total, n_targets, check_finite, runtime, norms) -> torch.Tensor | None:
    """Clip and step, unless the loss or the gradients are not finite (``check_finite``)."""
    fp16 = scaler.is_enabled()
    on_device = check_finite and not runtime.parallel and not fp16 and bool(optimizer.defaults.get("fused"))
    if check_finite and fp16 and not bool(torch.isfinite(total)):
        optimizer.zero_grad(set_to_none=True)
        return None
    scaler.unscale_(optimizer)  # clip the true gradients (a no-op unless fp16)
    norm = runtime.grad_norm(params, tc.grad_clip) if tc.grad_clip > 0 or (check_finite and not fp16) else None
    if norms is not None and norm is not None:
        norms.append(norm.detach().float())
    finite = None  # a finite loss can still backpropagate inf, which AdamW turns into NaN weights
    if check_finite and norm is not None:
        finite = torch.isfinite(total) & torch.isfinite(norm)
    if check_finite and not fp16 and not on_device and not bool(finite):
        optimizer.zero_grad(set_to_none=True)
        return None
    if on_device:
        optimizer.grad_scale, optimizer.found_inf = None, (~finite).float()
        try:
            optimizer.step()  # the fused kernel leaves weights, moments and step count as they were
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        optimizer.zero_grad(set_to_none=True)
        return torch.where(finite, total / n_targets, torch.nan)  # a skipped update reads as non-finite
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total / n_targets
