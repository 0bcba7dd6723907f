"""The seed's claims about the Transformer, as experiments on the real implementation.

Each probe is a module with ``run(**options) -> ProbeResult`` (a table, the full numbers
as ``data``, ``to_json()`` and ``save_plot(path)``)::

    from blockformer.probes import run_probe
    result = run_probe("toy")
    print(result)                      # the claim, a table, how to read it
    result.data["pre"]["output"]       # [1.7, 2.3]
    result.save_plot("toy.png")

On the command line: ``blockformer probe NAME [--plot FILE] [--json] [options]``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ..errors import UsageError
from ..schema import suggest
from .report import ProbeResult

# name -> one line: the claim each probe checks. Modules are imported when used.
PROBES: dict[str, str] = {
    "toy": "the seed's worked example through the real Block, Pre-Norm and Post-Norm",
    "equivariance": "no position signal + full visibility: permutation-equivariant; position or a mask "
    "breaks it",
    "gradients": "per-block gradient norms through depth: residuals carry the gradient",
    "scale": "per-block activation RMS through depth: what normalisation controls",
    "depth": "deep Post-Norm needs learning-rate warmup, Pre-Norm does not (Xiong et al. 2020)",
    "cost": "attention memory grows as T^2; the fused kernel; a Transformer layer vs an LSTM",
    "attention": "attention weights per layer and head, with entropy, for a checkpoint or a random model",
    "length": "loss past the training context, per position scheme; RoPE scaling and a sliding window",
}


def probe_module(name: str) -> ModuleType:
    """The module implementing probe ``name``; an unknown name is a UsageError."""
    if name not in PROBES:
        known = list(PROBES)
        raise UsageError(f"probe {name!r}: unknown{suggest(name, known)}; expected one of {', '.join(known)}")
    return importlib.import_module(f".{name}", __name__)


def run_probe(name: str, **options: Any) -> ProbeResult:
    """Run probe ``name`` with keyword ``options`` (the parameters of its ``run``)."""
    return probe_module(name).run(**options)


__all__ = ["PROBES", "ProbeResult", "probe_module", "run_probe"]
