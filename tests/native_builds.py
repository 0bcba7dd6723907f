"""Building blockformer's C kernels for another instruction set inside a test."""

import contextlib
import platform

import pytest

from blockformer import native


@contextlib.contextmanager
def kernels_built_for(cap: str | None, monkeypatch, *builds):
    """The kernels of ``builds`` (functools.cache'd loaders) built for ``cap``, an
    ``ATEN_CPU_CAPABILITY`` (None: this CPU; ``avx2``; ``default``: plain C), inside, and for
    this CPU again after."""
    if cap and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the instruction-set flags are x86's")
    if cap:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    for build in (native.load, *builds):
        build.cache_clear()
    try:
        assert cap != "avx2" or native.arch_flags() == ["-mavx2", "-mfma", "-mf16c"]
        assert cap != "default" or native.arch_flags() == []
        yield
    finally:
        monkeypatch.undo()
        for build in (native.load, *builds):
            build.cache_clear()
