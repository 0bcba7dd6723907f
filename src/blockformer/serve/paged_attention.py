"""Decode attention read straight from the paged pool: a small C kernel, built at first use.

A decoding row has one query and all its past as keys. Gathering those keys and values
through the block table into a copy and then running SDPA over the copy moves each byte
three times; at 64 rows of GPT-2-small that was a third of a step (BENCHMARKS.md "Paged
attention"). ``csrc/paged_attention.c`` reads each key and value once, where the block
table points, with the softmax in between, so its cost follows the cache's bytes. No
library ships such a kernel for the CPU and this torch (vLLM's CPU backend and IPEX carry
their own), so it is compiled here, with the machine's C compiler (``$CC``, else ``cc`` or
``gcc``) for the instruction set that ``ATEN_CPU_CAPABILITY`` leaves torch, into
``~/.cache/blockformer/kernels`` (``$XDG_CACHE_HOME``), once per source and CPU. Where no
compiler works, decode attention gathers and calls SDPA as the prefill chunks do, with a
warning: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..hardware import cpu_has

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
# -O3 vectorises the dot products and sums; reassociation is what lets it (no -ffast-math:
# the kernel compares against a finite floor and must keep its infinities honest).
CFLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros"]


def _arch_flags() -> list[str]:
    """This CPU's instruction set, no further than ``ATEN_CPU_CAPABILITY`` lets torch go."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if cpu_has("_is_avx512_supported"):
        return ["-march=native"]
    capped = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default"
    return ["-mavx2", "-mfma"] if cpu_has("_is_avx2_supported") and not capped else []


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return root / "blockformer" / "kernels"


def _cpu_id() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return platform.machine() + flags


@functools.cache
def kernel():
    """The compiled ``paged_decode_attention_f32``, or None (and a warning once) where it
    cannot be built on this machine."""
    flags = CFLAGS + _arch_flags()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + _cpu_id().encode()).hexdigest()[:16]
    try:
        lib = ctypes.CDLL(str(_built(key, flags)))
    except (OSError, RuntimeError) as e:
        warnings.warn(f"paged attention: the C kernel was not built ({e}); decode attention gathers keys and "
                      "values and calls SDPA instead (slower, same result)", RuntimeWarning, stacklevel=2)
        return None
    fn = lib.paged_decode_attention_f32
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    fn.restype = None
    return fn


def _built(key: str, flags: list[str]) -> Path:
    """The shared library for ``key``, compiled now if no earlier run left it."""
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"blockformer-kernels-{os.getuid()}"):
        lib = folder / f"paged_attention-{key}.so"
        if lib.is_file():
            return lib
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        cc = _compiler()
        tmp = folder / f".{lib.name}.{os.getpid()}"
        done = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            said = [line for line in done.stderr.splitlines() if "error" in line] or [f"exit {done.returncode}"]
            raise RuntimeError(f"{cc} failed: {said[0].strip()}")
        os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
        return lib
    raise RuntimeError(f"no writable folder for the built kernel ({_cache_dir()})")


def _compiler() -> str:
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
    for name in names:
        if shutil.which(name):
            return name
    raise RuntimeError(f"no C compiler: {' or '.join(map(repr, names))} is not on PATH (set CC)")


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="blockformer-attn")


def decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, read: torch.Tensor,
                     mask: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``out`` (rows, H, D) = attention of one query per row ``q`` (rows, H, D) over pool
    slots ``read`` (rows, S) where ``mask`` (rows, S) is True; pools (slots, H_kv, D). fp32,
    contiguous, on the CPU. Rows are split over torch's threads (the call releases the GIL)."""
    fn = kernel()
    rows, H, D = q.shape
    S, Hkv = read.shape[1], pool_k.shape[1]
    threads = max(1, min(torch.get_num_threads(), rows))
    scratch = torch.empty(threads, H * S, dtype=torch.float32)
    args = (q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), read.data_ptr(), mask.data_ptr(), out.data_ptr())
    if threads == 1:
        fn(*args, scratch.data_ptr(), 0, rows, S, H, Hkv, D, scale)
        return out
    bounds = [rows * i // threads for i in range(threads + 1)]
    jobs = [_pool(threads).submit(fn, *args, scratch[i].data_ptr(), bounds[i], bounds[i + 1], S, H, Hkv, D, scale)
            for i in range(threads)]
    for job in jobs:
        job.result()
    return out
