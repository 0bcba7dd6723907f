"""How close training runs to what the hardware allows: measured matmul peak and MFU.

Model FLOPs utilisation (MFU, Chowdhery et al. 2022, PaLM appendix B) is the FLOP/s the
model's arithmetic needs at the achieved token rate (``flops_per_token`` x tokens/s),
over the machine's peak. The peak here is measured, not read from a data sheet: the best
of a few square matmuls in the run's dtype, sized to take well under a second. It is
cached per machine (host, device, CPU threads) in ``~/.cache/blockformer/peak.json``, so a
run measures it at most once; ``blockformer info --peak`` measures it afresh.

Decoding at batch 1 has the other limit: each step reads every weight once, so its token
rate is at most the memory bandwidth over the weight bytes. ``memory_bandwidth`` measures
that one the same way (a streaming read of a buffer larger than any last-level cache) and
caches it beside the peaks.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch

from ..precision import DTYPES
from .setup import default_cache_dir

PEAK_FILE = "peak.json"
_CPU_SIZES = (256, 512, 1024, 2048)
_CUDA_SIZES = (2048, 4096, 8192)
READ_MIB = {"cpu": 512, "cuda": 4096}  # well past a CPU's last-level cache (tens of MiB) and a GPU's L2


def measure_peak(
    device: torch.device, dtype: torch.dtype, *, budget_s: float = 0.25, repeats: int = 3
) -> float:
    """Best matmul FLOP/s of ``device`` in ``dtype``: square ``n x n`` products for growing
    ``n`` until one takes longer than ``budget_s`` (larger matrices use the units better)."""
    best = 0.0
    g = torch.Generator().manual_seed(0)  # its own stream: a run's random state stays untouched
    for n in _CUDA_SIZES if device.type == "cuda" else _CPU_SIZES:
        a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        _sync(device)
        t0 = time.perf_counter()
        a @ b  # warm-up (kernel selection, first-touch)
        _sync(device)
        first = time.perf_counter() - t0
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            best = max(best, 2 * n**3 / max(time.perf_counter() - t0, 1e-9))
        if first > budget_s:
            break
    return best


def machine_key(device: torch.device) -> str:
    """What the peak depends on: the host, the device model, and the CPU threads used."""
    host = socket.gethostname()
    if device.type == "cuda":
        return f"{host}|cuda|{torch.cuda.get_device_name(device)}"
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{host}|cpu|{_cpu_model()}|{capability}|threads={torch.get_num_threads()}"


def peak_flops(
    device: torch.device, precision: str, *, refresh: bool = False, cache_dir: Path | None = None
) -> float:
    """This machine's matmul peak for ``precision`` (``fp32``/``bf16``/``fp16``), from the
    per-machine cache, else measured and cached; ``refresh`` measures again."""
    return _cached(device, precision, lambda: measure_peak(device, DTYPES[precision]), refresh, cache_dir)


def measure_bandwidth(device: torch.device, *, mib: int | None = None, repeats: int = 5) -> float:
    """Bytes per second that a streaming read draws from ``device``'s memory: the best of
    ``repeats`` sums of an fp32 buffer of ``mib`` MiB (default ``READ_MIB``), on the
    threads torch uses, as a decode step reads its weights."""
    n = (mib or READ_MIB[device.type]) * 2**20 // 4
    buffer = torch.ones(n, device=device)  # written once: every page is real memory before the timing
    best = 0.0
    for _ in range(repeats + 1):  # the first is a warm-up
        _sync(device)
        t0 = time.perf_counter()
        buffer.sum()
        _sync(device)
        best = max(best, 4 * n / max(time.perf_counter() - t0, 1e-9))
    return best


def memory_bandwidth(device: torch.device, *, refresh: bool = False, cache_dir: Path | None = None) -> float:
    """This machine's streaming-read bandwidth in bytes/s, cached as ``peak_flops`` is."""
    return _cached(device, "read", lambda: measure_bandwidth(device), refresh, cache_dir)


def _cached(device: torch.device, name: str, measure, refresh: bool, cache_dir: Path | None) -> float:
    """``measure()`` for this machine and ``name``, from the per-machine cache, else measured
    and cached; ``refresh`` measures again.

    A measurement errs only low (another process held a core meanwhile). On a CPU the figure
    with several threads is at least the one-thread figure, so a cached one below that is
    such an error: it is measured again (it made MFU read over 100%), and a new figure below
    it is used for this run but not cached."""
    path = (cache_dir or _default_cache_dir()) / PEAK_FILE
    key = f"{machine_key(device)}|{name}"
    table = _read(path)
    floor = 0.9 * _number(table.get(key.replace(f"|threads={torch.get_num_threads()}|", "|threads=1|")))
    cached = _number(table.get(key))
    if not refresh and cached > 0 and cached >= floor:
        return cached
    value = measure()
    if value < floor:
        return value  # contended now: the next quiet run measures again
    table[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    except OSError:
        pass  # a read-only home costs a measurement per run, nothing more
    return value


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def utilisation(flops_per_token: float, tokens: int, seconds: float, peak: float | None) -> dict[str, float]:
    """Achieved model FLOP/s for ``tokens`` in ``seconds`` (``flops_per_token`` counts the
    forward and backward passes), and MFU against ``peak`` when known."""
    achieved = flops_per_token * tokens / max(seconds, 1e-9)
    record = {"flops_per_s": achieved}
    if peak:
        record["mfu"] = achieved / peak
    return record


def format_bytes_per_s(value: float) -> str:
    """``14.2 GB/s``."""
    return f"{value / 1e9:.3g} GB/s"


def format_flops(value: float) -> str:
    """``1.23 TFLOP/s``."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e6:.3g} MFLOP/s"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform  # noqa: PLC0415

    return platform.processor() or platform.machine()


def _read(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _default_cache_dir() -> Path:
    return default_cache_dir()
