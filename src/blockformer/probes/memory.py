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

# The estimates made before a model is built (parameters and training memory at any depth, the
# RAM check) are arithmetic that training and parallel planning need too: they live in stats
# and are re-exported here under their old names.
from .. import stats as _stats
from ..data.describe import make_task_for
from ..stats import (  # noqa: F401
    EXACT_LAYERS,
    check_fits_in_memory,
    machine_memory_bytes,
    size_estimate,
)


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


def check_run_fits(cfg: Any, device: Any, make_task: Callable[[Any], Any] | None = None) -> None:
    """``stats.check_run_fits`` with its old signature: ``make_task`` defaults to
    ``data.make_task_for`` (the trainer itself passes it in, and imports nothing here)."""
    _stats.check_run_fits(cfg, device, make_task or make_task_for)
