"""Deterministic tensor-memory accounting: the peak bytes of live tensors during a call.

Allocator statistics are device-specific, and process-level figures (RSS) are noisy. Here
every tensor an aten op returns is seen through a ``TorchDispatchMode``; its storage is
counted once while it lives (a weak reference to the storage reports when the storage is
freed). The result depends only on the ops and shapes, so tests can assert it exactly.
Scratch buffers a kernel allocates internally (and frees before returning) are not seen:
the figure is what the computation keeps alive between ops.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """``with TensorMemory() as mem: f()`` -> ``mem.peak`` bytes, ``mem.largest`` (the largest
    single tensor) and ``mem.largest_shape``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self.largest_shape: tuple[int, ...] = ()
        self._seen: dict[int, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        if size > self.largest:
            self.largest, self.largest_shape = size, tuple(t.shape)
        self._seen[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.pop(key, None)


def measure(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` once under ``TensorMemory``: peak live bytes and the largest tensor."""
    with TensorMemory() as mem:
        result = fn()
        del result  # outputs count while they are alive
    return {"peak_bytes": mem.peak, "largest_bytes": mem.largest, "largest_shape": list(mem.largest_shape)}


# ---------------------------------------------------------------- estimates before building
EXACT_LAYERS = 64  # deeper configs are measured at two small depths and extrapolated


def size_estimate(cfg: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
    """Parameters (all, without embeddings, active) and ``stats.memory_estimate`` for ``cfg``
    without building it at its depth: every block of a stack holds the same parameters, so
    each figure is linear in the number of layers; a config deeper than ``EXACT_LAYERS`` is
    built (on the meta device) at depths 2 and 3 and extended along that line. A width whose
    tensors overflow torch's size limit raises a one-line ``UsageError``."""
    if cfg.total_layers <= EXACT_LAYERS:
        return _measured(cfg, batch_size, seq_len)
    if cfg.arch == "encoder-decoder":
        depths = {"n_encoder_layers": cfg.n_encoder_layers, "n_decoder_layers": cfg.n_decoder_layers}
    else:
        depths = {"n_layers": cfg.n_layers}
    small = dict.fromkeys(depths, 2)
    base = _measured(_replace(cfg, **small), batch_size, seq_len)
    out = dict(base)
    for name, depth in depths.items():
        step = _measured(_replace(cfg, **{**small, name: 3}), batch_size, seq_len)
        out = _combine(out, step, base, depth - 2)
    return out


def _combine(acc: Any, step: Any, base: Any, times: int) -> Any:
    """``acc + times * (step - base)``, leaf by leaf through nested dicts of integers."""
    if isinstance(acc, dict):
        return {k: _combine(acc[k], step[k], base[k], times) for k in acc}
    return acc + times * (step - base)


def _replace(cfg: Any, **depths: int) -> Any:
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(cfg, **depths)


def _measured(cfg: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
    """The figures of ``cfg``, from a model built on the meta device (no memory allocated)."""
    from ..errors import UsageError  # noqa: PLC0415
    from ..models import build_model  # noqa: PLC0415
    from ..stats import active_parameters, block_weights, count_parameters, memory_estimate  # noqa: PLC0415

    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except RuntimeError as e:  # "Storage size calculation overflowed with sizes=[...]"
        weights = block_weights(cfg) + cfg.d_model * cfg.vocab_size
        raise UsageError(
            f"model: d_model={cfg.d_model}, d_ff={cfg.d_ff}, vocab_size={cfg.vocab_size} give a tensor "
            f"too large for torch to allocate (about {weights:.3g} weights by arithmetic: {str(e).splitlines()[0]}); "
            "expected a smaller width"
        ) from None
    return {
        "parameters": count_parameters(model),
        "parameters_without_embeddings": count_parameters(model, exclude_embeddings=True),
        "active_parameters": active_parameters(model, cfg),
        "memory_bytes": memory_estimate(cfg, batch_size, seq_len),
    }


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    import os  # noqa: PLC0415

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_in_memory(cfg: Any, batch_size: int, seq_len: int, what: str) -> dict[str, Any]:
    """``size_estimate``, or a one-line ``UsageError`` when its training-memory estimate
    exceeds this machine's RAM: refused before anything is built (or hangs in swap)."""
    from ..errors import UsageError  # noqa: PLC0415

    est = size_estimate(cfg, batch_size, seq_len)
    ram, need = machine_memory_bytes(), est["memory_bytes"]["total_bytes"]
    if ram is not None and need > ram:
        raise UsageError(
            f"{what}: training needs about {need / 2**30:,.1f} GiB ({est['parameters']:,} parameters, a "
            f"micro-batch of {batch_size} x {seq_len} tokens, fp32 estimate) but this machine has "
            f"{ram / 2**30:,.1f} GiB of RAM; expected a smaller model, batch or sequence length"
        )
    return est


def check_run_fits(cfg: Any, device: Any) -> None:
    """``check_fits_in_memory`` for a run config about to train on ``device``: its micro-batch
    is ``train.batch_size`` sequences of the data's length (``train.max_tokens`` tokens for
    aligned pairs). Only on the CPU, where RAM is the bound; a GPU reports its own OOM."""
    if getattr(device, "type", str(device)) != "cpu":
        return
    m, data, tc = cfg.model, cfg.data, cfg.train
    if data.kind == "text":
        T, B = data.seq_len, tc.batch_size
    elif data.kind == "task":
        from ..train.setup import make_task_for  # noqa: PLC0415 - setup imports this module

        T, B = min(make_task_for(data).longest() + 1, m.max_seq_len), tc.batch_size
    elif data.kind == "pairs":
        T = m.max_seq_len
        B = max(1, tc.max_tokens // T)
    else:
        T, B = m.max_seq_len, tc.batch_size
    check_fits_in_memory(m, B, T, "model")
