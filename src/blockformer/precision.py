"""Where and in what precision to train: the device, autocast, and fp16's grad scaler.

``bf16`` runs the matmuls in bfloat16 under ``torch.autocast`` (weights and optimizer state
stay float32), on CUDA and on CPUs with bf16 units (AMX/AVX512-BF16). ``fp16`` has too
little range for unscaled gradients, so it needs a loss scaler (Micikevicius et al. 2018);
it is offered on CUDA only. ``auto`` picks bf16 where the device runs it natively (CUDA
with bf16; CPUs with AMX or AVX512-BF16) and fp32 elsewhere: on a CPU without bf16 units,
bf16 matmuls are emulated and run many times slower than fp32.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings

import torch

from . import kernels
from .errors import UsageError
from .hardware import cpu_has

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without the call where ``x`` already is ``dtype``: even a no-op
    ``to`` costs a dispatch (about 1 us), and an eager decode step makes a hundred of them."""
    return x if x.dtype == dtype else x.to(dtype)


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU is a usage error
    (naming ``option``, as the user spelled it)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{option}='cuda': no CUDA device is available; expected 'auto' or 'cpu'")
    return torch.device(name)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` has bfloat16 units: CUDA with bf16, or a CPU with AMX or AVX512-BF16."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return kernels.native_bf16_cpu()
    return False


def cpu_features() -> str:
    """What this CPU offers, for logs and benchmark tables: e.g. ``AVX512, AVX512-BF16``."""
    names = [torch.backends.cpu.get_cpu_capability()]
    names += [n for n, p in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported")) if cpu_has(p)]
    return ", ".join(names)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision to run: ``auto`` resolved for ``device``; an explicit ``bf16`` on a CPU
    without bf16 units is kept but warned about (once), with the measured slowdown."""
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if precision == "bf16" and device.type == "cpu" and not native_bf16(device):
        _warn_emulated_bf16()
    return precision


def describe_precision(requested: str, resolved: str, device: torch.device) -> str:
    """``bf16 (auto: native bf16 on this CPU: AVX512, AVX512-BF16)``, for the start-of-run line."""
    if requested != "auto":
        return resolved
    where = f"this CPU: {cpu_features()}" if device.type == "cpu" else f"this {device.type} device"
    native = "native bf16" if resolved == "bf16" else "no native bf16"
    return f"{resolved} (auto: {native} on {where})"


@functools.cache
def _warn_emulated_bf16() -> None:
    ratio = _bf16_slowdown()
    warnings.warn(
        f"precision 'bf16' on a CPU without bf16 units ({cpu_features()}): bf16 matmuls are "
        f"emulated here, measured {ratio:.1f}x the time of fp32 on a 256x256 matmul; "
        "'auto' or 'fp32' is faster on this machine",
        stacklevel=3,
    )


def _bf16_slowdown(n: int = 256, repeats: int = 10) -> float:
    """Time of a bf16 matmul over an fp32 one on this CPU (best of ``repeats``)."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n).to(dtype)
        a @ a  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t)
        times[dtype] = best
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


def check_precision(precision: str, device: torch.device, name: str = "train.precision") -> None:
    """``name``: how the user spelled the option (``--precision`` on the decoding commands)."""
    if precision == "fp16" and device.type != "cuda":
        raise UsageError(
            f"{name}='fp16': needs a CUDA device (got {device.type}); expected 'bf16' or 'fp32' here"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(f"{name}='bf16': this GPU lacks bfloat16; expected 'fp16' or 'fp32'")


def autocast(precision: str, device: torch.device, cache: bool = True) -> contextlib.AbstractContextManager:
    """The forward-pass context for ``precision``: a no-op for fp32.

    ``cache=False`` casts a weight anew at each use. torch keeps one cache of cast weights
    for the whole process and empties it whenever any thread leaves its outermost autocast,
    so forwards running side by side (``parallel.threads``) would take each other's casts and
    lose their own midway: a weight's gradient would then come through different cast nodes
    from one run to the next, and be summed differently (tested)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision], cache_enabled=cache)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A loss scaler, enabled only for fp16 (a disabled one passes calls through)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
