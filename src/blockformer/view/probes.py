"""What the probes page asks: the probes, their options, and one probe's result.

The options are the keyword parameters of each probe's ``run`` (as ``blockformer probe``
reads them), typed by their defaults; a probe runs through ``run_probe`` and its plot is
the one ``ProbeResult.save_plot`` draws, so the page shows exactly what the command does.
"""

from __future__ import annotations

import base64
import inspect
import math
import tempfile
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..probes import PROBES, probe_module, run_probe


EXPECTED = {bool: "true or false", int: "an integer", float: "a finite number", str: "text"}


def probe_list() -> list[dict[str, Any]]:
    """Each probe's name, claim and options (name, default, type)."""
    out = []
    for name, claim in PROBES.items():
        params = inspect.signature(probe_module(name).run).parameters.values()
        options = [{"name": p.name, "default": p.default, "type": _kind(p.default).__name__} for p in params]
        out.append({"name": name, "claim": claim, "options": options})
    return out


def _kind(default: Any) -> type:
    return type(default) if isinstance(default, (bool, int, float)) else str


def options_of(name: str, given: dict[str, Any], checkpoints: dict[str, Path]) -> dict[str, Any]:
    """The page's option strings as the types ``run`` takes; a checkpoint named as the pages
    list them (``RUN/CKPT``) becomes its path."""
    params = inspect.signature(probe_module(name).run).parameters
    options = {}
    for key, value in (given or {}).items():
        if key not in params:
            raise UsageError(f"probe {name}: no option {key!r}; expected one of {', '.join(params)}")
        kind = _kind(params[key].default)
        if value in ("", None):
            continue
        try:
            options[key] = _convert(kind, value)
        except ValueError:
            raise UsageError(f"{key}: {value!r}; expected {EXPECTED[kind]}") from None
        if key == "checkpoint" and value in checkpoints:
            options[key] = str(checkpoints[value])
    return options


def _convert(kind: type, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            return value if isinstance(value, bool) else str(value).lower() == "true"
        raise ValueError(value)
    result = kind(value)
    if isinstance(result, float) and not math.isfinite(result):
        raise ValueError(value)
    return result


def run(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A probe's result as the page draws it: its tables and notes, and its plot as a PNG data URL."""
    result = run_probe(name, **options)
    answer = result.to_dict()
    answer.pop("data", None)  # every number is in the tables and the plot; the page does not need them twice
    answer["plot"] = _plot(result) if result.plotter is not None else None
    return _finite(answer)


def _plot(result: Any) -> str:
    with tempfile.TemporaryDirectory() as folder:
        path = result.save_plot(Path(folder) / "plot.png")
        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _finite(value: Any) -> Any:
    """JSON-safe: NaN and infinities as None."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
