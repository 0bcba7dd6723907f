"""Swapping a model's ``nn.Linear`` layers in place: what quantizing and packing share."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> None:
    """Replace, in place, each ``nn.Linear`` of ``model`` for which ``make`` returns a module."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (new := make(child)) is not None:
                setattr(module, name, new)
