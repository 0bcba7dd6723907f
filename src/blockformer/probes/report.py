"""What every probe returns: the claim, a table, the full numbers, and a way to plot them.

A probe is a function ``run(**options) -> ProbeResult``. The result prints as a table,
serialises to JSON for machines (``to_json``), and draws itself to a PNG (``save_plot``)
with matplotlib's Agg canvas, so no display and no pyplot state are involved.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import UsageError


@dataclass
class ProbeResult:
    """One probe's outcome. ``data`` holds every number (JSON-compatible); ``columns`` and
    ``rows`` are the summary a person reads; ``plotter(result, figure)`` draws ``data``."""

    name: str
    claim: str
    columns: list[str]
    rows: list[list[Any]]
    data: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    # further tables printed after the main one: (title, columns, rows)
    more_tables: list[tuple[str, list[str], list[list[Any]]]] = field(default_factory=list)
    plotter: Callable[["ProbeResult", Any], None] | None = field(default=None, repr=False)

    def table(self) -> str:
        """The claim, the table, and the notes that say how to read it."""
        lines = [f"probe {self.name}: {self.claim}", "", format_table(self.columns, self.rows)]
        for title, columns, rows in self.more_tables:
            lines += ["", title, "", format_table(columns, rows)]
        if self.notes:
            lines += [""] + [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": self.name,
            "claim": self.claim,
            "columns": self.columns,
            "rows": [[_jsonable(v) for v in row] for row in self.rows],
            "more_tables": [
                {"title": t, "columns": c, "rows": [[_jsonable(v) for v in row] for row in r]}
                for t, c, r in self.more_tables
            ],
            "data": _jsonable(self.data),
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False, allow_nan=True)

    def save_plot(self, path: str | Path) -> Path:
        """Draw the result into a PNG at ``path`` (its folder must exist)."""
        from matplotlib.figure import Figure

        path = Path(path)
        if not path.parent.is_dir():
            raise UsageError(f"--plot {path}: folder {path.parent} does not exist; expected a writable path")
        if self.plotter is None:
            raise UsageError(f"probe {self.name}: has no plot")
        fig = Figure(figsize=(10, 6), layout="constrained")
        self.plotter(self, fig)
        fig.savefig(path, dpi=110)
        return path


def format_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A plain, aligned text table: text left, numbers right."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([_width(c)] + [_width(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(columns))]

    def pad(v: str, w: int, right: bool) -> str:
        fill = " " * (w - _width(v))
        return fill + v if right else v + fill

    def line(values: list[str]) -> str:
        return "  ".join(pad(v, w, num) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _width(text: str) -> int:
    """Columns ``text`` takes in a terminal: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "-"}[value]
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.detach().cpu().tolist())
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None  # JSON has no NaN; a diverged run reads as null
    return value


def parse_ints(text: str | list[int] | tuple[int, ...], name: str) -> list[int]:
    """``"8,16,32"`` (or a list) as positive ints; anything else is a UsageError naming ``name``."""
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(v) for v in str(text).split(",") if v.strip()]
        except ValueError:
            raise UsageError(f"{name}={text!r}: expected comma-separated integers, e.g. 8,16,32") from None
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise UsageError(f"{name}={text!r}: expected one or more integers >= 1")
    return values


def pick(names: str | list[str] | tuple[str, ...], allowed: list[str], name: str) -> list[str]:
    """A comma-separated selection from ``allowed``; an unknown entry is a UsageError."""
    if isinstance(names, (list, tuple)):
        values = list(names)
    else:
        values = [v.strip() for v in names.split(",") if v.strip()]
    for v in values:
        if v not in allowed:
            raise UsageError(f"{name}: unknown {v!r}; expected some of {', '.join(allowed)}")
    if not values:
        raise UsageError(f"{name}: expected some of {', '.join(allowed)}")
    return values


def log_ratio_axes(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    """Common styling of a log-scale line plot."""
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plot_label(text: str) -> str:
    """``text`` if matplotlib's default font can draw it, else its code points (``U+5C0F``):
    headless machines often have no CJK font, and a missing glyph draws as an empty box."""
    from matplotlib import font_manager, ft2font

    global _FONT
    if _FONT is None:
        _FONT = ft2font.FT2Font(font_manager.findfont(font_manager.FontProperties()))
    if all(ch.isspace() or _FONT.get_char_index(ord(ch)) for ch in text):
        return text.replace("\n", "\\n")
    return " ".join(f"U+{ord(ch):04X}" if not _FONT.get_char_index(ord(ch)) else ch for ch in text)


_FONT: Any = None
