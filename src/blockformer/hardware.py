"""What this machine's CPU offers: the precision defaults and the attention kernel choice
read it (never assume a CPU feature: detect it)."""

from __future__ import annotations

import torch


def cpu_has(probe: str) -> bool:
    """``torch.cpu.<probe>()``, e.g. ``_is_avx512_bf16_supported``; False where the (private)
    probe is absent from this torch build."""
    fn = getattr(torch.cpu, probe, None)
    return bool(fn()) if fn is not None else False
