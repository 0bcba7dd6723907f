"""Training metrics as JSON lines, and the loss curve drawn from them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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
            self.path.write_text("")
        elif self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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
    out = Path(out) if out is not None else Path(run_dir) / PLOT
    fig.savefig(out)
    plt.close(fig)
    return out


def perplexity(loss: float) -> float:
    """exp(loss), capped so a diverged run prints ``inf`` instead of overflowing."""
    return math.exp(loss) if loss < 700 else float("inf")
