"""Data parallelism inside one process: a micro-batch's rows split over CPU threads.

On a CPU with few cores, a small model's matmuls are too small to split well between
threads: at nanoGPT's CPU shape two threads on each 768-row product ran a step in 46 ms
where one thread on half the rows took 34 ms (a scratch timing of the plain loop on a Zen 4
EPYC capped to AVX2; what the split wins is in BENCHMARKS.md, "Rows split over threads").
``train.batch_threads`` splits each
micro-batch's rows instead (``shard_batch``, as the data-parallel ranks split a batch),
and each shard's forward and backward runs on its own thread with its share of torch's
threads (one each on two cores). torch releases the GIL inside every operator and the
autograd engine runs a CPU backward on the calling thread, so the shards run side by side.
Each shard's gradients come back on their own (``torch.autograd.grad``) and are added up in
shard order before they reach ``.grad``, so a run repeats itself exactly and equals the
unsplit step to rounding.

A model with dropout draws each shard's masks from a generator of its own
(``nn.dropout.generator``), seeded from torch's global one on the calling thread, one seed
per shard in shard order: the masks repeat with ``torch.manual_seed`` and a restored RNG
state, whatever order the threads run in.

Under bf16 autocast each shard casts the weights for itself (``precision.autocast(cache=False)``):
torch's cache of cast weights is one for the whole process, emptied whenever any thread leaves
autocast, and shards sharing it summed a weight's gradient in an order that changed from run
to run.

Splitting is refused (explicitly) or left off (``"auto"``) where the shards would share
state a thread cannot own: MoE layers (their forward leaves the auxiliary losses on the
module), activation checkpointing (it forks the global random state in the backward), a
compiled loss, fp16's loss scaler and a multi-process run; and for batches other than
language modelling and sequence-to-sequence ones.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import UsageError
from ..nn.dropout import generator as dropout_generator
from ..nn.moe import moe_layers
from .data import batch_rows, shard_batch

# ``"auto"`` splits on CPUs where torch runs this many threads or fewer: measured on 2
# (BENCHMARKS.md, "Rows split over threads"); more cores are left to an explicit setting.
AUTO_MAX_THREADS = 2


def draws_random(model: nn.Module) -> bool:
    """Whether a training forward of ``model`` draws random numbers (dropout anywhere)."""
    for m in model.modules():
        p = m.p if isinstance(m, nn.Dropout) else getattr(m, "dropout", None)
        if isinstance(p, float) and p > 0:
            return True
    return False


def _conflicts(model: nn.Module, tc: Any, device: torch.device, parallel: bool, splittable: bool) -> list[str]:
    """What rules out splitting rows over threads, each as the setting that does."""
    found = [] if splittable else ["this run's batches (labelled or array data: split by rows for LM and seq2seq only)"]
    if device.type != "cpu":
        found.append(f"train.device: {device.type} (threads split CPU work only)")
    if parallel:
        found.append("a multi-process run (its ranks split the batch already)")
    if tc.compile:
        found.append("train.compile: on")
    if tc.precision == "fp16":
        found.append("train.precision: fp16 (its loss scaler is not applied per shard)")
    if tc.activation_checkpointing != "none":
        found.append(f"train.activation_checkpointing: {tc.activation_checkpointing}")
    if moe_layers(model):
        found.append("MoE layers")
    return found


def resolve_batch_threads(setting: int | str, model: nn.Module, tc: Any, device: torch.device,
                          parallel: bool = False, threads: int | None = None, splittable: bool = True) -> int:
    """``train.batch_threads`` as a number of shards: ``"auto"`` is torch's thread count where
    that is 2 to ``AUTO_MAX_THREADS`` and nothing conflicts, else 1; a number > 1 that
    conflicts raises UsageError naming the setting in the way."""
    threads = torch.get_num_threads() if threads is None else threads
    found = _conflicts(model, tc, device, parallel, splittable)
    if setting == "auto":
        return threads if 2 <= threads <= AUTO_MAX_THREADS and not found else 1
    if setting > 1 and found:
        raise UsageError(f"train.batch_threads={setting}: rows cannot be split over threads with {found[0]}; "
                         "expected train.batch_threads=1 (or 'auto', which decides)")
    return int(setting)


def _single_threaded(per_thread: int) -> None:
    torch.set_num_threads(per_thread)


class RowThreads:
    """``n`` shards of each micro-batch, one on the calling thread and the rest on a pool of
    ``n - 1`` threads, each on its share of torch's threads. From the first ``backward``
    until ``release`` (or ``close``) the calling thread keeps its share for everything it
    runs (the optimizer step too): handing the whole count back between steps let torch's
    idle OpenMP threads compete with the next step's shards, which made the split step
    slower than the whole one (BENCHMARKS.md). ``all_threads`` lends it back for a block
    (an evaluation). ``n = 1`` runs everything on the caller and changes nothing. ``random``:
    the model draws dropout masks, each shard from its own generator."""

    def __init__(self, n: int, random: bool = False) -> None:
        self.n, self.random = n, random
        self.per_thread = max(1, torch.get_num_threads() // n)
        self.pool = (ThreadPoolExecutor(n - 1, "blockformer-rows", _single_threaded, (self.per_thread,))
                     if n > 1 else None)
        self._held: int | None = None  # the caller's thread count while it runs on its share

    def backward(self, shard_loss: Callable[[Any], torch.Tensor], batch: Any, params: list[torch.Tensor],
                 scale: float) -> torch.Tensor:
        """Backpropagate ``shard_loss(shard) * scale`` for each shard of ``batch``'s rows, the
        gradients added into ``params``' ``.grad`` in shard order; returns the summed
        (unscaled, detached) loss."""
        n = min(self.n, batch_rows(batch))
        if self.pool is None or n == 1:
            loss = shard_loss(batch)
            (loss * scale).backward()
            return loss.detach()

        seeds = torch.randint(1 << 62, (n,)).tolist() if self.random else None  # torch's stream, in shard order

        def run(i: int) -> tuple[torch.Tensor, tuple]:
            masks = (dropout_generator(torch.Generator().manual_seed(seeds[i])) if seeds is not None
                     else contextlib.nullcontext())
            with masks:
                loss = shard_loss(shard_batch(batch, i, n))
            return loss.detach(), torch.autograd.grad(loss * scale, params, allow_unused=True)

        outs = self._map(run, n)
        for j, p in enumerate(params):
            grads = [g[j] for _, g in outs if g[j] is not None]
            if grads:
                total = sum(grads[1:], grads[0])  # in shard order: the same sum every run
                p.grad = total if p.grad is None else p.grad.add_(total)
        return sum((loss for loss, _ in outs[1:]), outs[0][0])

    def _map(self, fn: Callable[[int], Any], n: int) -> list[Any]:
        """``fn(0)`` on this thread and ``fn(1..n-1)`` on the pool; every shard is finished
        before an error from any of them is raised."""
        if self._held is None:
            self._held = torch.get_num_threads()
            torch.set_num_threads(self.per_thread)
        futures = [self.pool.submit(fn, i) for i in range(1, n)]
        try:
            first = fn(0)
        finally:
            errors = [e for e in (f.exception() for f in futures) if e is not None]  # waits for each
        if errors:
            raise errors[0]
        return [first, *(f.result() for f in futures)]

    def release(self) -> None:
        """Give the calling thread its own thread count back (the next ``backward`` takes its
        share again)."""
        if self._held is not None:
            torch.set_num_threads(self._held)
            self._held = None

    @contextlib.contextmanager
    def all_threads(self) -> Iterator[None]:
        """The calling thread's own thread count for the block, its share after it."""
        held = self._held
        self.release()
        try:
            yield
        finally:
            if held is not None:
                self._held = torch.get_num_threads()
                torch.set_num_threads(self.per_thread)

    def close(self) -> None:
        self.release()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def __enter__(self) -> RowThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
