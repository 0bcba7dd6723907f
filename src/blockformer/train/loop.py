"""The training loop: a short function; each feature lives in its own small module.

``train(cfg)`` builds the tokenizer, model and data from a run config (or restores them
from a checkpoint), then repeats: gather ``grad_accum`` micro-batches, backpropagate their
token-weighted loss, clip, step AdamW and the schedule. Every ``eval_every`` steps it
evaluates, saves a checkpoint and keeps the last k and the best. SIGINT/SIGTERM, or
``train.max_minutes`` running out, finish the current step, save, and return.

The run directory is locked for the whole call (``run_dir.RunLock``); a fresh run refuses
a directory that holds an earlier run unless ``overwrite``.

A kept checkpoint is always finite. Each step checks its loss and its gradients' norm
(computed for clipping anyway) on the device: a non-finite one makes no update, and stops
the run (``NonFiniteLoss``, the checkpoints on disk kept) or, with
``train.nonfinite="skip"``, is skipped. A finite loss and gradient can still give
non-finite weights (an lr so large the update overflows) or finite weights that overflow
in the forward pass, so the weights and the validation loss are checked again at each
evaluation, before anything is saved: one 2-norm per tensor, once per evaluation rather
than per step. There ``stop`` stops, naming the last finite checkpoint, and ``skip``
puts the weights and optimizer state back as they were at that checkpoint (or at the
start of the run) and carries on.
"""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import parallel
from ..errors import UsageError
from ..models.checks import trusted_inputs
from ..nn.moe import auxiliary_loss, routing_stats
from ..parallel.checkpoint import (
    full_optimizer_state,
    load_optimizer_state,
    load_sharded,
    same_layout,
    save_sharded,
)
from ..run_config import RunConfig
from ..stats import count_parameters, flops_per_token
from .checkpoint import (
    best_checkpoint,
    load_trainer_state,
    load_weights,
    mark_best,
    prune,
    resolve_checkpoint,
    save_checkpoint,
    step_checkpoints,
    step_dir_name,
)
from .compile import LossFn, compile_loss, resolve_compile
from .metrics import MetricsLog, perplexity, plot_losses
from .finetune import lr_scale
from .finite import diverged_message, finite_weights, restore_finite
from .optim import build_optimizer, kernel_kept
from ..precision import autocast, check_precision, describe_precision, grad_scaler, resolve_device, resolve_precision
from .run_dir import CONFIG_TOML, RunLock, clear_previous_run, main_process, prepare, replace_file
from .schedule import build_scheduler, load_scheduler_state
from .setup import Objective, build_run
from .throughput import format_flops, peak_flops, utilisation


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    checkpoint: Path | None  # the last checkpoint written
    best: Path | None  # the checkpoint with the lowest validation loss
    losses: list[float] = field(default_factory=list)  # training loss of each step of this call
    val: dict[str, float] = field(default_factory=dict)  # the last evaluation
    interrupted: bool = False
    signal: int | None = None  # SIGINT/SIGTERM when a signal stopped the run
    skipped: int = 0  # steps whose update was skipped for a non-finite loss (train.nonfinite="skip")
    restored: int = 0  # evaluations that found non-finite weights or loss and went back (skip)
    main: bool = True  # False on every rank of a parallel run but rank 0 (which reports)


class NonFiniteLoss(UsageError):
    """The training loss, the gradients, the weights or the validation loss became NaN or
    infinite (``train.nonfinite="stop"``)."""

    exit_code = 3


def train(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    resume: str | Path | None = None,
    stop_at: int | None = None,
    log: Any = print,
    overwrite: bool = False,
) -> TrainResult:
    """Train ``cfg`` into ``run_dir``; ``resume`` continues from a checkpoint (or a run
    directory's latest). ``stop_at`` ends this call early at that step, saving a checkpoint,
    as if interrupted. A fresh run into a directory holding an earlier run raises
    UsageError unless ``overwrite``; another process training there raises UsageError."""
    run_dir = Path(run_dir)
    par = parallel.start(cfg, resolve_device(cfg.train.device))  # None: one process, no parallel section
    lock = RunLock(run_dir)

    def own_run_dir() -> list[Path]:
        if par is None and not main_process():  # a rank > 0 outside our process group: rank 0 owns it
            return []
        lock.acquire()
        return prepare(run_dir, fresh=resume is None, overwrite=overwrite)

    try:
        cleaned = parallel.on_main(par, own_run_dir)  # rank 0 owns the directory; all ranks learn if it could
        if cleaned:
            log(f"{run_dir}: removed {len(cleaned)} temporary entries left by an interrupted run")
        return _train(cfg, run_dir, resume=resume, stop_at=stop_at, log=log, overwrite=overwrite, par=par)
    finally:
        if lock.held:
            lock.release()
        if par is not None:
            par.close()


def _train(cfg: RunConfig, run_dir: Path, *, resume, stop_at, log, overwrite, par) -> TrainResult:
    tc = cfg.train
    device = resolve_device(tc.device) if par is None else par.device
    main = par is None or par.is_main
    if par is not None:
        log = log if main else _quiet
        log(f"parallel: {par.describe()}")
    requested = tc.precision
    tc = dataclasses.replace(tc, precision=resolve_precision(requested, device),  # cfg keeps "auto"
                             compile=resolve_compile(tc.compile, cfg.model))
    check_precision(tc.precision, device)
    state = None
    if resume is not None:
        resume = resolve_checkpoint(resume, prefer="latest")
        state = load_trainer_state(resume)
    else:
        torch.manual_seed(tc.seed)
    run = build_run(cfg, device, tokenizer_from=resume, log=log)
    cfg, model, objective = run.config, run.model, run.objective  # model.vocab_size now set
    full_optim, sharded = None, same_layout(par, state)  # sharded: each rank reads only its shards
    if resume is not None and not sharded:
        load_weights(model, resume, device)
        if par is not None or "optimizer" not in state:  # another layout wrote it, or will read it
            full_optim = full_optimizer_state(model, cfg, resume, state)
    model, fwd_model = parallel.parallelize(model, cfg, par, tc)  # model: this rank's parameters
    optimizer = build_optimizer(model, tc, lr_scale(model, cfg))
    scheduler = build_scheduler(optimizer, tc, cfg.model.d_model)
    scaler = grad_scaler(tc.precision, device)
    step, best_loss = 0, float("inf")
    if state is not None:
        with kernel_kept(optimizer):
            if sharded:
                load_sharded(model, optimizer, resume)
            elif full_optim is None:
                optimizer.load_state_dict(state["optimizer"])
            else:
                load_optimizer_state(par, model, optimizer, full_optim)
        load_scheduler_state(scheduler, state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        objective.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        step, best_loss = state["step"], state["best_val_loss"]
    elif overwrite and main:
        clear_previous_run(run_dir, log)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        replace_file(run_dir / CONFIG_TOML, cfg.to_toml().encode("utf-8"))
    metrics = MetricsLog(run_dir, resume_step=step if state is not None else None) if main else _NoMetrics()
    # One process: model + loss compiled as one static graph; a parallel run compiles per block.
    loss_fn = compile_loss(objective) if tc.compile and par is None else None
    log(
        f"training {cfg.model.arch} ({count_parameters(model) / 1e6:.2f}M parameters, "
        f"{count_parameters(model, trainable_only=True) / 1e6:.3f}M trainable) on {device} "
        f"in {describe_precision(requested, tc.precision, device)}, {tc.steps} steps -> {run_dir}"
    )
    # MFU: the model's FLOPs at the achieved rate over this machine's measured matmul peak.
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len if cfg.model.arch == "decoder" else None)
    # A parallel run's tokens are the global batch's: its peak is every rank's together.
    peak = peak_flops(device, tc.precision) * (par.degrees.world_size if par is not None else 1) if main else None
    log(f"throughput: {flops_tok:.3g} training FLOPs per token; {tc.precision} matmul peak "
        f"{format_flops(peak or 0)} (`blockformer info --peak` measures it again)")

    params = [p for p in model.parameters() if p.requires_grad]
    good = resume  # the last checkpoint known finite; skip mode goes back to it
    initial = None  # ... or, before the first, to these: the trainable weights at the start
    if resume is None and tc.nonfinite == "skip" and par is None:
        initial = [p.detach().to("cpu", copy=True) for p in params]

    def back_to_good(what: str) -> None:
        """Non-finite ``what`` at this evaluation: stop, or (skip) restore the last finite state."""
        if tc.nonfinite == "stop" or par is not None:
            raise NonFiniteLoss(diverged_message(what, step, tc, good, par is not None))
        restore_finite(model, optimizer, scaler, params, good, initial, device)
        result.restored += 1
        log(f"step {step}: {what} NaN or infinite; weights and optimizer state restored from "
            f"{good or 'the start of the run'}")

    def checked_eval() -> dict[str, float]:
        """The validation metrics of finite weights, written to the metrics and the log."""
        for attempt in range(2):
            val = _evaluate(objective, model, tc, device) if finite_weights(params, par) else None
            if val is not None and math.isfinite(val["val_loss"]):
                break
            what = "the weights" if val is None else "the validation loss"
            if attempt:  # restoring did not help: the checkpoint itself is bad
                raise NonFiniteLoss(diverged_message(what, step, tc, good, par is not None))
            back_to_good(what)
        _report(val, step, metrics, bar, log)
        return val

    def save(val: dict[str, float] | None) -> Path:
        nonlocal best_loss, good, initial
        trainer_state = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "data": objective.state_dict(),
            "rng": get_rng_state(),
            "best_val_loss": min(best_loss, val["val_loss"]) if val else best_loss,
        }
        directory = run_dir / step_dir_name(step)
        if par is None:
            trainer_state["optimizer"] = optimizer.state_dict()
            path = save_checkpoint(directory, model, run.tokenizer, cfg, trainer_state)
        else:  # the optimizer state is sharded: in the checkpoint's dcp/
            path = save_sharded(par, directory, model, optimizer, run.tokenizer, cfg, trainer_state)
        good, initial = path, None  # checked finite before saving
        if val and val["val_loss"] < best_loss:
            best_loss = val["val_loss"]
            if main:
                mark_best(run_dir, path)
        if main:
            prune(run_dir, tc.keep_last)
        return path

    result = TrainResult(run_dir=run_dir, step=step, checkpoint=None, best=None)
    last_stop = tc.steps if stop_at is None else min(stop_at, tc.steps)
    stopper = _Stopper()
    bar = _progress(tc, step, last_stop) if main else None
    pending: list[tuple[int, torch.Tensor]] = []  # (step, loss on the device), read at log steps
    t0, tokens_seen, targets_seen = time.perf_counter(), 0, 0
    deadline = time.monotonic() + 60 * tc.max_minutes if tc.max_minutes else float("inf")
    with stopper:
        while step < last_stop and not stopper.requested and time.monotonic() < deadline:
            batches = [objective.next_batch() for _ in range(tc.grad_accum)]
            lr = scheduler.get_last_lr()[0]
            loss = train_step(fwd_model, objective, batches, optimizer, scaler, params, tc, device,
                              check_finite=True, par=par, loss_fn=loss_fn)
            if loss is None:  # non-finite, seen on the host
                loss = torch.full((), float("nan"), device=device)
            pending.append((step + 1, loss))  # a non-finite one made no update; counted when read
            scheduler.step()
            step += 1
            tokens_seen += sum(objective.count_tokens(b) for b in batches)  # host ints: no sync
            targets_seen += sum(objective.count_targets(b) for b in batches)
            if bar is not None:
                bar.update(1)
            if step % tc.log_every == 0 or step == last_stop:
                losses = _read(pending, step, tc, run_dir, result, log)
                pending.clear()
                result.losses.extend(losses)
                elapsed = max(time.perf_counter() - t0, 1e-9)
                tok_s = tokens_seen / elapsed
                util = utilisation(flops_tok, targets_seen, elapsed, peak)
                finite = [x for x in losses if math.isfinite(x)]  # skipped steps (train.nonfinite=skip) are nan
                loss = sum(finite) / len(finite) if finite else float("nan")  # the mean since the last log
                metrics.write({"split": "train", "step": step, "loss": loss, "lr": lr, "tokens_per_s": tok_s,
                               **util, **routing_stats(model)})
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}",
                                    mfu=f"{100 * util.get('mfu', 0):.1f}%")
                t0, tokens_seen, targets_seen = time.perf_counter(), 0, 0
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                _read(pending, step, tc, run_dir, result, log, count=False)  # no checkpoint after a NaN
                t_eval = time.perf_counter()
                result.val = checked_eval()
                result.checkpoint = save(result.val)
                t0 += time.perf_counter() - t_eval  # tokens/s counts training time only
        result.losses.extend(_read(pending, step, tc, run_dir, result, log))
        if result.checkpoint is None or not result.checkpoint.name.endswith(f"{step:06d}"):
            if not finite_weights(params, par):
                back_to_good("the weights")
            result.checkpoint = save(None)  # stopped between evaluations
    if bar is not None:
        bar.close()
    result.step = step
    result.interrupted = step < tc.steps
    result.signal = stopper.signal
    result.best = best_checkpoint(run_dir)
    result.main = main
    if main:
        plot_losses(run_dir)
    return result


def _read(
    pending, step: int, tc, run_dir: Path, result: TrainResult, log: Any, count: bool = True
) -> list[float]:
    """The pending losses, read in one host sync. A non-finite one stops the run (before
    anything is saved) or is counted as skipped; ``count=False`` only checks."""
    values = torch.stack([loss for _, loss in pending]).tolist() if pending else []
    bad = [s for (s, _), v in zip(pending, values) if not math.isfinite(v)]
    if bad and (count or tc.nonfinite == "stop"):
        _nonfinite(bad, step, tc, run_dir, result, log)
    return values


def _nonfinite(bad_steps: list[int], step: int, tc, run_dir: Path, result: TrainResult, log: Any) -> None:
    """``train.nonfinite``: stop with the last checkpoint named, or count the skipped updates."""
    if tc.nonfinite == "stop":
        last = step_checkpoints(run_dir)
        raise NonFiniteLoss(
            f"train: the loss became NaN or infinite at step {bad_steps[0]}; that step made no update and "
            f"the run stopped at step {step} without saving. "
            f"Last checkpoint: {last[-1] if last else 'none'}. "
            f"Expected a finite loss and gradients: lower train.lr (now {tc.lr:g}), raise train.warmup, "
            f"or set train.nonfinite=skip to skip such steps"
        )
    for s in bad_steps:
        result.skipped += 1
        if result.skipped in (1, 10, 100) or result.skipped % 1000 == 0:
            log(f"step {s}: non-finite loss, update skipped ({result.skipped} so far)")


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
    par: parallel.Parallel | None = None,
    *,
    loss_fn: LossFn | None = None,
) -> torch.Tensor | None:
    """One optimizer update from ``batches`` (the micro-batches of gradient accumulation),
    each weighted by its share of the target tokens; returns the mean loss per token.
    With ``check_finite``, a NaN or infinite loss or gradient norm makes no update: one
    process with fused AdamW skips it on the device (its ``found_inf`` input, as
    ``GradScaler`` uses it) and the loss comes back non-finite, with no host sync; otherwise
    the host checks and None comes back (fp16: the loss only; its scaler skips inf
    gradients). ``loss_fn`` replaces ``objective.loss`` (the compiled one, under ``train.compile``).
    In a parallel run ``batches`` are global: each rank computes the loss of its rows
    (``par.local_batch``) and the total is the global batch's."""
    model.train()
    n_targets = sum(objective.count_targets(b) for b in batches)
    total = torch.zeros((), device=device)
    if par is not None and par.pipeline is not None:
        total = par.pipeline.step(batches, n_targets, tc)
    else:
        for batch in batches:
            # The run's own tokenizer made these ids (< vocab_size by construction): the models'
            # value checks would read them on the host, a device sync per micro-batch.
            local = batch if par is None else par.local_batch(batch)
            with parallel.loss_context(par, tc.label_smoothing):  # TP: logits stay split by vocabulary
                with autocast(tc.precision, device), trusted_inputs():
                    loss_sum = (loss_fn or objective.loss)(model, local, tc.label_smoothing)
                aux = auxiliary_loss(model)  # what modules (MoE routers) recorded in this forward, or None
                objective_sum = loss_sum if aux is None else loss_sum + aux * objective.count_targets(local)
                share = objective_sum / n_targets if par is None else objective_sum * par.grad_scale / n_targets
                scaler.scale(share).backward()
            total += loss_sum.detach()
        total = parallel.loss_total(par, total)
    fp16 = scaler.is_enabled()
    on_device = check_finite and par is None and not fp16 and bool(optimizer.defaults.get("fused"))
    if check_finite and fp16 and not bool(torch.isfinite(total)):
        optimizer.zero_grad(set_to_none=True)
        return None
    scaler.unscale_(optimizer)  # clip the true gradients (a no-op unless fp16)
    norm = _clip(params, tc, par, measure=check_finite and not fp16)
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


def _clip(params: list[torch.nn.Parameter], tc: Any, par, *, measure: bool) -> torch.Tensor | None:
    """Clip the gradients' global norm to ``train.grad_clip`` (when > 0); returns the norm
    before clipping (on the device), computed without clipping only when ``measure``."""
    if tc.grad_clip <= 0 and not measure:
        return None
    if par is not None:
        return par.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    if tc.grad_clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def _evaluate(objective: Objective, model, tc, device) -> dict[str, float]:
    with autocast(tc.precision, device):
        val = objective.evaluate(model, tc)
    if objective.token_loss:  # perplexity means something only for a loss per token
        val["val_ppl"] = perplexity(val["val_loss"])
    return val


def _report(val: dict[str, float], step: int, metrics, bar, log) -> None:
    metrics.write({"split": "val", "step": step, **val})
    text = "  ".join(f"{k} {v:.4g}" for k, v in val.items())
    (bar.write if bar is not None else log)(f"step {step}: {text}")


def _progress(tc, start: int, stop: int):
    if not tc.progress:
        return None
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=stop, initial=start, desc="train", unit="step", dynamic_ncols=True, smoothing=0.1)


def _quiet(*args, **kwargs) -> None:
    """The log of every rank but rank 0."""


class _NoMetrics:
    def write(self, record: dict) -> None:
        pass


# ---------------------------------------------------------------------- RNG state
def get_rng_state() -> dict[str, Any]:
    """Every random stream training reads (dropout: torch; anything else: python, numpy)."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _Stopper:
    """Turns SIGINT/SIGTERM into a request to stop after the current step (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None  # the signal that asked to stop
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True
        self.signal = signum

    def __enter__(self) -> "_Stopper":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
