"""blockformer: the Transformer's standard block, stacked into encoders, decoders and
encoder-decoders, with the training, generation and probes around it.

The names below load on first use (PEP 562), so ``python -m blockformer`` and the
``blockformer`` command import torch inside the command line's own error handling: a
Ctrl-C while it loads is one line and exit 130, not a traceback.
"""

from __future__ import annotations

import getpass
import importlib
import os
import tempfile
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _inductor_cache_per_capability() -> None:
    """Under ``ATEN_CPU_CAPABILITY`` (``avx2`` on an AVX-512 CPU: a first look at the AVX2
    kernels), inductor's cache lives in its own directory, ``<cache>-avx2``. Inductor keys its
    compiled graphs without that cap but builds their C++ for it, so a graph cached by an
    uncapped run comes back with 16-lane loops compiled for 8 lanes: the process segfaults
    (GPT-2's compiled decode step did, 2026-12-03). Set before torch compiles anything, and once."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not cap:
        return
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        base = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    base = base.rstrip(os.sep)
    if not base.endswith(f"-{cap}"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{base}-{cap}"


_inductor_cache_per_capability()

_EXPORTS = {
    "TransformerConfig": ".config",
    "Block": ".nn",
    "KVCache": ".nn",
    "build_model": ".models",
    "DecoderModel": ".models",
    "EncoderModel": ".models",
    "EncoderDecoderModel": ".models",
    "count_parameters": ".stats",
    "flops_per_token": ".stats",
    "memory_estimate": ".stats",
    "from_hf": ".interop",
    "to_hf": ".interop",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .config import TransformerConfig
    from .interop import from_hf, to_hf
    from .models import DecoderModel, EncoderDecoderModel, EncoderModel, build_model
    from .nn import Block, KVCache
    from .stats import count_parameters, flops_per_token, memory_estimate


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'blockformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
