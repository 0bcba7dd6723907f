"""Swapping a model's ``nn.Linear`` layers in place: what quantizing and packing share."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from torch import nn

from .. import native


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> None:
    """Replace, in place, each ``nn.Linear`` of ``model`` for which ``make`` returns a module."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (new := make(child)) is not None:
                setattr(module, name, new)


def load_operators_for(model: nn.Module, kind: type | tuple[type, ...]) -> None:
    """Where ``model`` holds CPU layers of ``kind`` (layers that call blockformer's C kernels),
    load the kernels' C++ operators (``native.load_cpp_ops``: built once per machine, 10-20 s),
    so that each product is one dispatcher call, not a Python function around ctypes."""
    if any(isinstance(m, kind) and any(t.is_cpu for t in itertools.chain(m.parameters(), m.buffers()))
           for m in model.modules()):
        native.load_cpp_ops()
