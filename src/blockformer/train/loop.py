"""The training loop: a short function over small named parts.

``train(cfg)`` joins the processes it runs on (``parallel.start``: one process, or this
rank of a torchrun job), builds the tokenizer, model and data from a run config (or
restores them from a checkpoint: ``_start``), then repeats: one optimizer update
(``step.train_step``), a log line every ``log_every`` steps (``_log``), and every
``eval_every`` steps an evaluation and a checkpoint, keeping the last k and the best
(``_evaluate_and_save``). SIGINT/SIGTERM, or ``train.max_minutes`` running out, finish
the current step, save, and return (``_finish``). The loop knows no model, task or
parallel layout: the objective, the model's own loss and the runtime answer for them.

The run directory is locked for the whole call (``run_dir.RunLock``); a fresh run refuses
a directory that holds an earlier run unless ``overwrite``, and ``train.resume="auto"``
continues the run there from its latest checkpoint (what a torchrun restart runs).

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import parallel
from ..errors import UsageError
from ..models import training_metrics
from ..parallel.checkpoint import full_optimizer_state
from ..parallel.mesh import stopped_ranks
from ..parallel.threads import RowThreads, draws_random, resolve_batch_threads
from ..parallel.meta import wanted as meta_init_wanted
from ..paths import replace_file
from ..precision import autocast, check_precision, describe_precision, grad_scaler, resolve_device, resolve_precision
from ..run_config import RunConfig
from ..stats import count_parameters, flops_per_token
from .checkpoint import (
    best_checkpoint,
    mark_best,
    prune,
    resolve_checkpoint,
    save_checkpoint,
    step_checkpoints,
    step_dir_name,
)
from .compile import compile_loss, resolve_compile
from .finetune import init_sharded, lr_scale, parts_of, resume_in_parts, resumes_in_parts
from .finite import diverged_message, finite_weights, restore_finite
from .load import load_trainer_state, load_weights
from .metrics import perplexity, plot_losses
from .optim import build_optimizer, kernel_kept
from .rng import get_rng_state, set_rng_state
from .run_dir import CONFIG_TOML, RunLock, clear_previous_run, main_process, prepare
from .schedule import build_scheduler, load_scheduler_state
from .setup import build_run
from .step import train_step
from .stopper import Stopper
from .throughput import format_flops, peak_flops, utilisation
from .samples import lm_samples, samples_at_eval
from .tracking import Tracker, check_reporters, open_tracker

__all__ = ["train", "train_step", "TrainResult", "NonFiniteLoss", "get_rng_state", "set_rng_state"]


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
    sampled_step: int | None = None  # the last step whose text samples went to TensorBoard


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
    directory's latest); without it, ``train.resume="auto"`` continues from ``run_dir``'s own
    latest checkpoint when it has one (written by the same config: checked), else starts
    fresh. ``stop_at`` ends this call early at that step, saving a checkpoint, as if
    interrupted. A fresh run into a directory holding an earlier run raises UsageError
    unless ``overwrite``; another process training there raises UsageError. A collective
    that waits ``parallel.timeout`` for a rank, or loses one, raises ``StoppedRanks``."""
    run_dir = Path(run_dir)
    auto = cfg.train.resume == "auto" and resume is None
    if auto and overwrite:
        raise UsageError("train.resume='auto' (--resume-if-exists): continues the run in its directory; --overwrite "
                         "replaces that run with a fresh one: expected one of them")
    runtime = parallel.start(cfg, resolve_device(cfg.train.device))
    lock = RunLock(run_dir)

    def own_run_dir() -> tuple[list[Path], Path | None]:
        if not runtime.parallel and not main_process():  # a rank > 0 outside our process group
            return [], None
        lock.acquire()
        return prepare(run_dir, fresh=resume is None, overwrite=overwrite, auto=cfg if auto else None)

    try:
        # rank 0 owns the directory; every rank learns if it could, and the checkpoint "auto" found
        cleaned, latest = runtime.on_main(own_run_dir)
        if cleaned and runtime.is_main:
            log(f"{run_dir}: removed {len(cleaned)} temporary entries left by an interrupted run")
        if latest is not None:
            resume = latest
            if runtime.is_main:
                log(f"{run_dir}: train.resume=auto: continuing from {latest.name}")
        run = _start(cfg, run_dir, runtime, resume=resume, overwrite=overwrite, log=log)
        with run.tracker, run.threads:  # event files flushed and closed on every way out: an error, Ctrl-C
            return _loop(run, stop_at)
    except RuntimeError as e:  # a collective timed out or lost a rank: one line naming the silent ranks
        stopped = stopped_ranks(e, cfg.parallel.timeout) if runtime.parallel else None
        if stopped is None:
            raise
        raise stopped from None
    finally:
        if lock.held:
            lock.release()
        runtime.close()


@dataclass
class _Run:
    """What one call of ``train`` holds while it runs."""

    cfg: RunConfig
    tc: Any  # cfg.train with precision, compile and batch_threads resolved
    run_dir: Path
    runtime: Any  # parallel.Local or parallel.Parallel
    model: torch.nn.Module  # this rank's parameters
    fwd_model: torch.nn.Module  # what the step calls (DDP-wrapped, say)
    objective: Any  # objective.Objective
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    log: Any
    step: int = 0
    best_loss: float = float("inf")
    good: Path | None = None  # the last checkpoint known finite; skip mode goes back to it
    initial: list[torch.Tensor] | None = None  # ... or, before the first, the weights at the start
    tracker: Tracker = field(default_factory=Tracker)  # metrics.jsonl and train.report_to's reporters
    loss_fn: Any = None
    flops_per_token: float = 0.0
    peak: float | None = None
    bar: Any = None
    lr: float = 0.0
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, loss on the device)
    window: _Window = field(default_factory=lambda: _Window())
    result: TrainResult | None = None

    def __post_init__(self) -> None:
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # what the optimizer updates
        self.threads = RowThreads(self.tc.batch_threads, random=draws_random(self.model))  # threads start at step 1


@dataclass
class _Window:
    """Training time and tokens since the last log line (evaluation time left out)."""

    t0: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    targets: int = 0
    norms: list[torch.Tensor] = field(default_factory=list)  # each step's gradient norm, on the device


def _start(cfg: RunConfig, run_dir: Path, runtime: Any, *, resume, overwrite: bool, log: Any) -> _Run:
    """Tokenizer, model, objective, optimizer and schedule, fresh or restored from ``resume``."""
    device, main = runtime.device, runtime.is_main
    check_reporters(cfg.train.report_to)
    if runtime.parallel:
        log = log if main else _quiet
        log(f"parallel: {runtime.describe()}")
    requested = cfg.train.precision
    tc = dataclasses.replace(cfg.train, precision=resolve_precision(requested, device),  # cfg keeps "auto"
                             compile=resolve_compile(cfg.train.compile, cfg.model))
    check_precision(tc.precision, device)
    state = None
    if resume is not None:
        resume = resolve_checkpoint(resume, prefer="latest")
        state = load_trainer_state(resume, mmap=runtime.parallel)  # a rank touches its part of the moments
    else:
        torch.manual_seed(tc.seed)
    in_parts = resumes_in_parts(runtime, resume, state)  # each rank reads its part of it
    init_parts = (parts_of(cfg.train.init_from) if resume is None and cfg.train.init_from and runtime.parallel
                  else None)
    loads_whole = (not runtime.reads_own_shards(state) and not in_parts if resume is not None  # else its shards
                   else bool(cfg.train.init_from) and runtime.parallel and init_parts is None)
    on_meta = meta_init_wanted(cfg, runtime, loads_whole)
    built = build_run(cfg, device, tokenizer_from=resume, log=log, meta=on_meta)
    cfg = built.config  # model.vocab_size now set
    full_optim = None if on_meta else _read_checkpoint(built.model, cfg, runtime, resume, state, device)
    model, fwd_model = parallel.parallelize(built.model, cfg, runtime, tc)  # model: this rank's parameters
    rows = getattr(runtime, "rows", None)
    if on_meta and resume is None and cfg.train.init_from:  # each rank reads its part of the base
        init_sharded(model, cfg, init_parts, rows, log)
    elif on_meta and in_parts:  # its part of the weights now, of the moments with the optimizer
        full_optim = resume_in_parts(model, cfg, resume, state, rows)
    optimizer = build_optimizer(model, tc, lr_scale(model, cfg))
    tc = dataclasses.replace(tc, batch_threads=resolve_batch_threads(
        tc.batch_threads, model, tc, device, runtime.parallel, splittable=built.objective.rows_split))
    run = _Run(cfg, tc, run_dir, runtime, model, fwd_model, built.objective, built.tokenizer, optimizer,
               build_scheduler(optimizer, tc, cfg.model.d_model), grad_scaler(tc.precision, device), log, good=resume)
    if state is not None:
        _restore(run, resume, state, full_optim)
    elif overwrite and main:
        clear_previous_run(run_dir, log)
    if resume is None and tc.nonfinite == "skip" and not runtime.parallel:
        run.initial = [p.detach().to("cpu", copy=True) for p in run.params]
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        replace_file(run_dir / CONFIG_TOML, cfg.to_toml().encode("utf-8"))
    # One process: model + loss compiled as one static graph; a parallel run compiles per block.
    run.loss_fn = compile_loss(run.objective) if tc.compile and not runtime.parallel else None
    _announce(run, requested)
    if main:  # last: nothing after it can fail and leave its files open
        run.tracker = open_tracker(run_dir, cfg, resume_step=run.step if state is not None else None)
    return run


def _read_checkpoint(model, cfg: RunConfig, runtime, resume, state, device) -> dict | None:
    """The weights of ``resume`` into the unwrapped ``model``, unless each rank reads its own
    shards later; returns the optimizer state in full when another layout wrote it."""
    if resume is None or runtime.reads_own_shards(state):
        return None
    load_weights(model, resume, device)
    if not runtime.parallel and "optimizer" in state:
        return None
    return full_optimizer_state(model, build_optimizer(model, cfg.train, lr_scale(model, cfg)), resume, state)


def _restore(run: _Run, resume: Path, state: dict[str, Any], full_optim: dict | None) -> None:
    """Optimizer, schedule, scaler, data position, random streams and step of ``resume``."""
    with kernel_kept(run.optimizer):
        run.runtime.load_optimizer(run.model, run.optimizer, resume, state, full_optim)
    load_scheduler_state(run.scheduler, state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.objective.load_state_dict(state["data"])
    set_rng_state(state["rng"])
    run.step, run.best_loss = state["step"], state["best_val_loss"]


def _announce(run: _Run, requested: str) -> None:
    """The start-of-run lines: what trains where, and the FLOPs the utilisation is measured by."""
    cfg, tc, model, device = run.cfg, run.tc, run.model, run.runtime.device
    run.log(
        f"training {cfg.model.arch} ({count_parameters(model) / 1e6:.2f}M parameters, "
        f"{count_parameters(model, trainable_only=True) / 1e6:.3f}M trainable) on {device} "
        f"in {describe_precision(requested, tc.precision, device)}, {tc.steps} steps -> {run.run_dir}"
    )
    if tc.batch_threads > 1:
        run.log(f"threads: each micro-batch's rows split over {tc.batch_threads} threads (train.batch_threads)")
    # MFU: the model's FLOPs at the achieved rate over this machine's measured matmul peak.
    run.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len if cfg.model.arch == "decoder" else None)
    # A parallel run's tokens are the global batch's: its peak is every rank's together.
    run.peak = peak_flops(device, tc.precision) * run.runtime.world_size if run.runtime.is_main else None
    run.log(f"throughput: {run.flops_per_token:.3g} training FLOPs per token; {tc.precision} matmul peak "
            f"{format_flops(run.peak or 0)} (`blockformer info --peak` measures it again)")


def _loop(run: _Run, stop_at: int | None) -> TrainResult:
    tc = run.tc
    run.result = TrainResult(run_dir=run.run_dir, step=run.step, checkpoint=None, best=None)
    last = tc.steps if stop_at is None else min(stop_at, tc.steps)
    run.bar = _progress(tc, run.step, last) if run.runtime.is_main else None
    deadline = time.monotonic() + 60 * tc.max_minutes if tc.max_minutes else float("inf")
    run.window = _Window()
    with Stopper() as stopper:
        while run.step < last and not stopper.requested and time.monotonic() < deadline:
            _step(run)
            if run.step % tc.log_every == 0 or run.step == last:
                _log(run)
            if (tc.eval_every and run.step % tc.eval_every == 0) or run.step == tc.steps:
                with run.threads.all_threads():  # rows split over threads: evaluate on all of them
                    _evaluate_and_save(run)
        _finish(run)
    run.result.interrupted = run.step < tc.steps
    run.result.signal = stopper.signal
    return run.result


def _step(run: _Run) -> None:
    objective, device = run.objective, run.runtime.device
    batches = [objective.next_batch() for _ in range(run.tc.grad_accum)]
    run.lr = run.scheduler.get_last_lr()[0]
    loss = train_step(run.fwd_model, objective, batches, run.optimizer, run.scaler, run.params, run.tc, device,
                      check_finite=True, runtime=run.runtime, loss_fn=run.loss_fn, norms=run.window.norms,
                      threads=run.threads)
    if loss is None:  # non-finite, seen on the host
        loss = torch.full((), float("nan"), device=device)
    run.pending.append((run.step + 1, loss))  # a non-finite one made no update; counted when read
    run.scheduler.step()
    run.step += 1
    run.window.tokens += sum(objective.count_tokens(b) for b in batches)  # host ints: no sync
    run.window.targets += sum(objective.count_targets(b) for b in batches)
    if run.bar is not None:
        run.bar.update(1)


def _log(run: _Run) -> None:
    """The mean training loss and gradient norm since the last log, tokens/s and utilisation,
    to the metrics."""
    losses = _read(run)
    run.pending.clear()
    run.result.losses.extend(losses)
    elapsed = max(time.perf_counter() - run.window.t0, 1e-9)
    tok_s = run.window.tokens / elapsed
    util = utilisation(run.flops_per_token, run.window.targets, elapsed, run.peak)
    loss = _finite_mean(losses)  # skipped steps (train.nonfinite=skip) are nan
    norms = torch.stack(run.window.norms).tolist() if run.window.norms else []  # computed: no wait
    norm = {"grad_norm": _finite_mean(norms)} if norms else {}  # before clipping
    run.tracker.write({"split": "train", "step": run.step, "loss": loss, "lr": run.lr, **norm,
                       "tokens_per_s": tok_s, **util, **training_metrics(run.model)})
    if run.bar is not None:
        run.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{run.lr:.2e}", tok_s=f"{tok_s:,.0f}",
                            mfu=f"{100 * util.get('mfu', 0):.1f}%")
    run.window = _Window()


def _evaluate_and_save(run: _Run) -> None:
    _read(run, count=False)  # no checkpoint after a NaN
    t_eval = time.perf_counter()
    run.result.val = _checked_eval(run)
    run.result.checkpoint = _save(run, run.result.val)
    _log_samples(run)
    run.window.t0 += time.perf_counter() - t_eval  # tokens/s counts training time only
    run.tracker.flush()  # what TensorBoard shows of a live run is at most one evaluation old


def _log_samples(run: _Run) -> None:
    """Text samples into TensorBoard at an evaluation (``samples_at_eval``); a sample that
    cannot be made (a prompt the tokenizer cannot encode) never fails the run."""
    if not samples_at_eval(run.cfg) or run.runtime.world_size != 1:
        return
    try:
        texts = lm_samples(run.model, run.tokenizer, run.cfg)
    except ValueError:  # UsageError included
        return
    for i, text in enumerate(texts):
        run.tracker.text(f"samples/{i}", text, run.step)
    run.result.sampled_step = run.step


def _finish(run: _Run) -> None:
    """The losses not yet read; a checkpoint when the run stopped between evaluations."""
    run.result.losses.extend(_read(run))
    checkpoint = run.result.checkpoint
    if checkpoint is None or not checkpoint.name.endswith(f"{run.step:06d}"):
        if not finite_weights(run.params, run.runtime):
            _back_to_good(run, "the weights")
        run.result.checkpoint = _save(run, None)
    if run.bar is not None:
        run.bar.close()
    run.result.step = run.step
    run.result.best = best_checkpoint(run.run_dir)
    run.result.main = run.runtime.is_main
    if run.runtime.is_main:
        plot_losses(run.run_dir)


def _read(run: _Run, count: bool = True) -> list[float]:
    """The pending losses, read in one host sync. A non-finite one stops the run (before
    anything is saved) or is counted as skipped; ``count=False`` only checks."""
    values = torch.stack([loss for _, loss in run.pending]).tolist() if run.pending else []
    bad = [s for (s, _), v in zip(run.pending, values) if not math.isfinite(v)]
    if bad and (count or run.tc.nonfinite == "stop"):
        _nonfinite(run, bad)
    return values


def _nonfinite(run: _Run, bad_steps: list[int]) -> None:
    """``train.nonfinite``: stop with the last checkpoint named, or count the skipped updates."""
    tc, result = run.tc, run.result
    if tc.nonfinite == "stop":
        last = step_checkpoints(run.run_dir)
        raise NonFiniteLoss(
            f"train: the loss became NaN or infinite at step {bad_steps[0]}; that step made no update and "
            f"the run stopped at step {run.step} without saving. "
            f"Last checkpoint: {last[-1] if last else 'none'}. "
            f"Expected a finite loss and gradients: lower train.lr (now {tc.lr:g}), raise train.warmup, "
            f"or set train.nonfinite=skip to skip such steps"
        )
    for s in bad_steps:
        result.skipped += 1
        if result.skipped in (1, 10, 100) or result.skipped % 1000 == 0:
            run.log(f"step {s}: non-finite loss, update skipped ({result.skipped} so far)")


def _back_to_good(run: _Run, what: str) -> None:
    """Non-finite ``what`` at this evaluation: stop, or (skip) restore the last finite state."""
    if run.tc.nonfinite == "stop" or run.runtime.parallel:
        raise NonFiniteLoss(diverged_message(what, run.step, run.tc, run.good, run.runtime.parallel))
    restore_finite(run.model, run.optimizer, run.scaler, run.params, run.good, run.initial, run.runtime.device)
    run.result.restored += 1
    run.log(f"step {run.step}: {what} NaN or infinite; weights and optimizer state restored from "
            f"{run.good or 'the start of the run'}")


def _checked_eval(run: _Run) -> dict[str, float]:
    """The validation metrics of finite weights, written to the metrics and the log."""
    for attempt in range(2):
        val = _evaluate(run) if finite_weights(run.params, run.runtime) else None
        if val is not None and math.isfinite(val["val_loss"]):
            break
        what = "the weights" if val is None else "the validation loss"
        if attempt:  # restoring did not help: the checkpoint itself is bad
            raise NonFiniteLoss(diverged_message(what, run.step, run.tc, run.good, run.runtime.parallel))
        _back_to_good(run, what)
    run.tracker.write({"split": "val", "step": run.step, **val})
    text = "  ".join(f"{k} {v:.4g}" for k, v in val.items())
    (run.bar.write if run.bar is not None else run.log)(f"step {run.step}: {text}")
    return val


def _evaluate(run: _Run) -> dict[str, float]:
    objective = run.objective
    with autocast(run.tc.precision, run.runtime.device):
        val = objective.evaluate(run.model, run.tc)
    if objective.token_loss:  # perplexity means something only for a loss per token
        val["val_ppl"] = perplexity(val["val_loss"])
    return val


def _save(run: _Run, val: dict[str, float] | None) -> Path:
    """A checkpoint of this step (finite: checked before); the best marked, old ones pruned."""
    trainer_state = {
        "step": run.step,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "data": run.objective.state_dict(),
        "rng": get_rng_state(),
        "best_val_loss": min(run.best_loss, val["val_loss"]) if val else run.best_loss,
    }
    path = run.runtime.save(run.run_dir / step_dir_name(run.step), run.model, run.optimizer, run.tokenizer,
                            run.cfg, trainer_state, write=save_checkpoint)
    run.good, run.initial = path, None
    if val and val["val_loss"] < run.best_loss:
        run.best_loss = val["val_loss"]
        if run.runtime.is_main:
            mark_best(run.run_dir, path)
    if run.runtime.is_main:
        prune(run.run_dir, run.tc.keep_last)
    return path


def _progress(tc, start: int, stop: int):
    if not tc.progress:
        return None
    from tqdm.auto import tqdm  # noqa: PLC0415 - the progress bar is optional

    return tqdm(total=stop, initial=start, desc="train", unit="step", dynamic_ncols=True, smoothing=0.1)


def _quiet(*args, **kwargs) -> None:
    """The log of every rank but rank 0."""


def _finite_mean(values: list[float]) -> float:
    finite = [x for x in values if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else float("nan")
