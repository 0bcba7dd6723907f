"""What this machine's CPU offers: ``kernels`` reads it for every hardware-dependent choice
(precision ``auto``, attention, weight packing), never assuming a CPU feature but detecting it."""

from __future__ import annotations

import os

import torch

# The probes that need more than AVX2. ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) caps
# torch's kernels below them; the choices made from these probes follow the same cap, so one
# variable makes an AVX-512 machine decide and compute as an AVX2-only one does.
BEYOND_AVX2 = frozenset({"_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                         "_is_amx_tile_supported", "_is_amx_fp16_supported"})


def cpu_has(probe: str) -> bool:
    """``torch.cpu.<probe>()``, e.g. ``_is_avx512_bf16_supported``; False where the (private)
    probe is absent from this torch build, or above the cap that ``ATEN_CPU_CAPABILITY`` sets."""
    if probe in BEYOND_AVX2 and os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        return False
    fn = getattr(torch.cpu, probe, None)
    return bool(fn()) if fn is not None else False
