"""Small C kernels, built at first use with the machine's C compiler.

Where no library ships a kernel for the CPU and this torch (decode attention that reads a
paged pool in place, or a cache from memory; a weight-only int8 product at a decode step's few
rows), blockformer
carries its own, in plain C under ``csrc/``, vectorised by the compiler. Each is compiled
once per source and CPU with ``$CC`` (else ``cc`` or ``gcc``), for the instruction set that
``ATEN_CPU_CAPABILITY`` leaves torch (so ``avx2`` gives an AVX2 build on any machine), into
``~/.cache/blockformer/kernels`` (``$XDG_CACHE_HOME``; a temporary folder if that is not
writable), and loaded with ``ctypes``. A kernel splits its work over ``pieces`` threads
itself, with OpenMP: the library is linked against ``libgomp.so.1``, which is torch's own
runtime once torch is loaded, so the kernels wake torch's idle threads (a few microseconds)
rather than threads of their own (a Python thread pool cost 140 us a call). A compiler
without OpenMP builds the same kernels single-threaded. Where no compiler works, ``load``
warns once and returns None, and the caller takes its torch path: slower, never wrong.

The decode products among them, and the cache's decode attention, are also operators of torch's dispatcher, so a compiled step
can call them: ``matmul_op`` registers each Python function as one, and ``csrc/ops.cpp``
defines the same products in C++ (``torch.ops.blockformer_c``), built against torch's headers
by ``load_cpp_ops`` when a model is prepared for decoding (``make install`` builds it ahead),
which takes the Python function out of every call, eager or compiled.
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
from collections.abc import Callable
from pathlib import Path

import torch

from .hardware import cpu_has

SOURCES = Path(__file__).with_name("csrc")
# -O3 vectorises the dot products and sums; reassociation is what lets it (no -ffast-math:
# the kernels compare against finite floors and must keep infinities honest).
CFLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros"]


def arch_flags() -> list[str]:
    """This CPU's instruction set, no further than ``ATEN_CPU_CAPABILITY`` lets torch go."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if cpu_has("_is_avx512_supported"):
        return ["-march=native"]
    capped = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default"  # F16C: every AVX2 CPU has it (fp16 caches)
    return ["-mavx2", "-mfma", "-mf16c"] if cpu_has("_is_avx2_supported") and not capped else []


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` built and loaded, or None (and a warning, once) where it cannot be
    built on this machine."""
    source = SOURCES / f"{name}.c"
    for threading in (["-fopenmp"], []):  # without OpenMP: the same kernel on one thread
        flags = CFLAGS + arch_flags() + threading
        code = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))  # headers too
        key = hashlib.sha256(code + " ".join(flags).encode() + _cpu_id().encode()).hexdigest()[:16]
        try:
            return ctypes.CDLL(str(_built(source, f"{name}-{key}.so", flags)))
        except (OSError, RuntimeError) as e:
            error = e
    warnings.warn(f"{name}: the C kernel was not built ({error}); blockformer uses torch's ops instead (slower, "
                  "same result)", RuntimeWarning, stacklevel=2)
    return None


def function(name: str, symbol: str, pointers: int, sizes: int, *tail) -> Callable | None:
    """``symbol`` of ``csrc/<name>.c``, taking ``pointers`` pointers, ``sizes`` int64s and then
    the ctypes of ``tail``, or None (and a warning, once) where it cannot be built."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * sizes + list(tail)
    fn.restype = None
    return fn


_OPS = torch.library.Library("blockformer", "DEF")


def matmul_op(fn: Callable) -> None:
    """Register ``fn(x, w, ...)``, a product of ``x``'s rows (along its last dimension) by ``w``'s
    output channels, as ``torch.ops.blockformer.<its name>``: a compiled graph calls it as one opaque op (eager
    code calls ``fn`` itself, with no dispatcher in between). Defined as a plain CPU kernel of a
    ``torch.library.Library``, not a ``torch.library.custom_op``, whose Python wrapping cost
    about 9 us more a call (a decode step makes 49; BENCHMARKS.md "What a call to a C kernel
    costs around it"); the schema is still read from ``fn``'s annotations."""
    name = fn.__name__
    _OPS.define(name + torch.library.infer_schema(fn, mutates_args=()))
    _OPS.impl(name, fn, "CPU")
    torch.library.register_fake(f"blockformer::{name}", _fake, lib=_OPS)


# Whether torch.ops.blockformer_c (csrc/ops.cpp) is loaded: a plain flag, which torch.compile can read.
CPP_OPS = False
_CPP_KERNELS = (("f32_matmul", "f32_matmul_f32"), ("int8_matmul", "int8_matmul_f32"),
                ("int4_matmul", "int4_matmul_f32"), ("int4_a8_matmul", "int4_a8_matmul_f32"),
                ("int8_a8_matmul", "int8_a8_matmul_f32"), ("decode_attention", "decode_attention_f32"))


@functools.cache
def load_cpp_ops() -> bool:
    """Build ``csrc/ops.cpp`` against this torch (once per machine; about 10-20 s) and load it,
    so that ``call`` takes its C++ operators: the decode products without a Python function in
    between. Where it cannot be built (no C++ compiler, no torch headers, a C kernel missing),
    a warning once and False: the Python operators of ``matmul_op`` stay, slower, never wrong.
    Called where a model is prepared for decoding, not inside ``torch.compile``."""
    global CPP_OPS
    if CPP_OPS:  # loaded: the operators and their fakes are registered once per process
        return True
    kernels = [load(name) for name, _ in _CPP_KERNELS]
    if any(k is None for k in kernels):
        return False
    source = SOURCES / "ops.cpp"
    try:
        from torch.utils import cpp_extension

        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        flags = ["-O2", "-std=c++20", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                 *(f"-I{p}" for p in cpp_extension.include_paths())]
        libs = (*(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu")
        stamp = " ".join([*flags, *libs, torch.__version__]).encode()
        key = hashlib.sha256(source.read_bytes() + stamp).hexdigest()
        lib = _built(source, f"ops-{key[:16]}.so", flags, libs, cxx=True)
        torch.ops.load_library(str(lib))
        addresses = [ctypes.cast(getattr(k, symbol), ctypes.c_void_p)
                     for k, (_, symbol) in zip(kernels, _CPP_KERNELS)]
        ctypes.CDLL(str(lib)).blockformer_c_set_kernels(*addresses)
        for name, _ in _CPP_KERNELS:
            torch.library.register_fake(f"blockformer_c::{name}", _fake_attention if "attention" in name else _fake)
    except (OSError, RuntimeError, subprocess.SubprocessError, ImportError) as e:
        warnings.warn(f"ops.cpp: the C++ operators were not built ({e}); blockformer calls the C kernels from "
                      "Python instead (slower, same result)", RuntimeWarning, stacklevel=2)
        return False
    CPP_OPS = True
    return True


def _fake(x: torch.Tensor, w: torch.Tensor, *rest) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _fake_attention(q: torch.Tensor, *rest) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def ready(library: Callable) -> bool:
    """Whether a product can go to the kernel ``library()`` builds: eagerly where it is built;
    inside ``torch.compile`` always, since tracing cannot call ``library`` (the op checks when it runs)."""
    return torch.compiler.is_compiling() or library() is not None


def call(fn: Callable, *args) -> torch.Tensor:
    """``fn(*args)``: its C++ operator where ``load_cpp_ops`` loaded them; else ``fn`` itself
    eagerly and, inside ``torch.compile``, its Python operator (``matmul_op``)."""
    if CPP_OPS:
        return getattr(torch.ops.blockformer_c, fn.__name__)(*args)
    return (getattr(torch.ops.blockformer, fn.__name__) if torch.compiler.is_compiling() else fn)(*args)


def pieces(total: int) -> int:
    """How many threads a kernel splits ``total`` items over: torch's, at most one per item."""
    return max(1, min(torch.get_num_threads(), total))


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "blockformer" / "kernels"


def _cpu_id() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return platform.machine() + flags


def _compiler(cxx: bool = False) -> str:
    variable, names = ("CXX", ["c++", "g++"]) if cxx else ("CC", ["cc", "gcc"])
    names = [os.environ[variable]] if os.environ.get(variable) else names
    for name in names:
        if shutil.which(name):
            return name
    raise RuntimeError(f"no C{'++' if cxx else ''} compiler: {' or '.join(map(repr, names))} is not on PATH "
                       f"(set {variable})")


def compile_command(source: Path, output: Path, flags: list[str], libs: tuple[str, ...] = ("-lm",),
                    cxx: bool = False) -> list[str]:
    """The command line that builds the C (``cxx``: C++) file ``source`` into the shared
    library ``output``."""
    return [_compiler(cxx), *flags, "-o", str(output), str(source), *libs]


def _built(source: Path, filename: str, flags: list[str], libs: tuple[str, ...] = ("-lm",),
           cxx: bool = False) -> Path:
    """The shared library ``filename``, compiled now if no earlier run left it."""
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"blockformer-kernels-{os.getuid()}"):
        lib = folder / filename
        if lib.is_file():
            return lib
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        tmp = folder / f".{filename}.{os.getpid()}"
        command = compile_command(source, tmp, flags, libs, cxx)
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            said = [line for line in done.stderr.splitlines() if "error" in line] or [f"exit {done.returncode}"]
            raise RuntimeError(f"{command[0]} failed: {said[0].strip()}")
        os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
        return lib
    raise RuntimeError(f"no writable folder for the built kernel ({_cache_dir()})")
