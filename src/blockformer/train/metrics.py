"""Training metrics as JSON lines, and the loss curve drawn from them.

Neither file is ever written through a link: ``metrics.jsonl`` is appended to with
``O_NOFOLLOW`` and rewritten (on resume) by renaming a new file over it; ``loss.png`` is
rendered in memory and renamed into place, so a full disk is an ``OSError`` naming it.
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..paths import replace_file
from ..textformats import loads_json

METRICS = "metrics.jsonl"
PLOT = "loss.png"


class MetricsLog:
    """Appends one JSON object per line to ``run_dir/metrics.jsonl``.

    On resume, records past the resumed step (written after the checkpoint by the
    interrupted run) are dropped first, so the file describes one consistent run.
    """

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            replace_file(self.path, b"")
        elif self.path.exists() or self.path.is_symlink():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            replace_file(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:  # one write per record: a kill leaves at most the last line torn
            f.write(line)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (or of a run directory's). A torn last line, what a
    kill during an append leaves, is dropped with a warning; a bad line before it is a
    UsageError naming the file and the line."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), 1) if line.strip()]
    records = []
    for k, (n, line) in enumerate(lines):
        try:
            record = loads_json(line.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if k == len(lines) - 1:
                warnings.warn(f"{path}: line {n} is cut short (an interrupted write?); ignored", stacklevel=2)
                break
            raise UsageError(f"{path}: line {n} is not a metrics record ({e}); expected one JSON object "
                             f"per line, as the trainer writes them") from None
        records.append(record)
    return records


def plot_losses(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Train and validation loss against step, as a PNG (headless); None without data."""
    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("split") == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("split") == "val"]
    if not train and not val:
        return None
    import matplotlib  # noqa: PLC0415 - a slow import, needed once per run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", linewidth=1.5, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()  # rendered in memory: the file is written (and its errors raised) here
    fig.savefig(png, format="png")
    plt.close(fig)
    out = Path(out) if out is not None else Path(run_dir) / PLOT
    replace_file(out, png.getvalue())
    return out


def perplexity(loss: float) -> float:
    """exp(loss), capped so a diverged run prints ``inf`` instead of overflowing."""
    return math.exp(loss) if loss < 700 else float("inf")
