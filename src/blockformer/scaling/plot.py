"""The sweep as one PNG: loss curves, the Chinchilla fit, Kaplan's L(N), the iso-FLOP frontier."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..train.metrics import read_metrics
from .fit import ChinchillaFit


def say_skipped(ax: Any, why: str) -> None:
    """Write "fit skipped: <why>" inside ``ax``: a panel without its fit says so, never blank."""
    import textwrap  # noqa: PLC0415

    ax.text(0.5, 0.5, textwrap.fill(f"fit skipped: {why}", 45), transform=ax.transAxes, ha="center",
            va="center", fontsize=9, color="C3", bbox={"facecolor": "white", "edgecolor": "C3", "alpha": 0.9})


def _train_record(r: dict) -> bool:
    """A training record with a finite step and loss (others are not drawn)."""
    return r.get("split") == "train" and all(
        isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) and math.isfinite(r[k])
        for k in ("step", "loss"))


def plot_sweep(summary: dict[str, Any], path: str | Path) -> Path:
    """Draw ``sweep_figure(summary)`` into the PNG ``path``."""
    path = Path(path)
    sweep_figure(summary).savefig(path, dpi=100)
    return path


def sweep_figure(summary: dict[str, Any]) -> Any:
    """The four panels as a matplotlib ``Figure``; a panel whose fit was skipped says why."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    points = summary["points"]
    sizes = sorted({p["size"] for p in points}, key=lambda s: next(q["parameters"] for q in points if q["size"] == s))
    colors = {s: f"C{i}" for i, s in enumerate(sizes)}
    fig = Figure(figsize=(12, 9), layout="constrained")
    (curves, vs_d), (vs_n, iso) = fig.subplots(2, 2)
    fit = None
    if "chinchilla" in summary:
        c = {k: summary["chinchilla"][k] for k in ("E", "A", "B", "alpha", "beta", "objective")}
        fit = ChinchillaFit(**c)

    for p in points:  # training loss against tokens seen, per run
        per_step = p["tokens"] / p["steps"]
        train = [(r["step"] * per_step, r["loss"]) for r in read_metrics(p["run_dir"]) if _train_record(r)]
        if train:
            curves.plot(*zip(*train), color=colors[p["size"]], lw=0.8, alpha=0.7)
        curves.plot(p["tokens"], p["val_loss"], "o", color=colors[p["size"]], ms=4)
    curves.set(xscale="log", xlabel="tokens", ylabel="loss (nats/token)", title="training loss; dots: final val loss")

    d_grid = np.geomspace(min(p["tokens"] for p in points) / 2, max(p["tokens"] for p in points) * 4, 50)
    for s in sizes:
        mine = [p for p in points if p["size"] == s]
        vs_d.plot([p["tokens"] for p in mine], [p["val_loss"] for p in mine], "o", color=colors[s],
                  label=f"{s} ({mine[0]['parameters'] / 1e6:.2f}M)")
        if fit is not None:
            vs_d.plot(d_grid, fit.predict(mine[0]["parameters"], d_grid), "-", color=colors[s], lw=1)
    if "holdout" in summary:
        h = summary["holdout"]
        vs_d.plot(h["tokens"], h["val_loss"], "k*", ms=10, label=f"{h['size']} (not fitted)")
        if fit is not None:
            vs_d.plot(d_grid, fit.predict(h["parameters"], d_grid), "k--", lw=1)
    vs_d.set(xscale="log", xlabel="tokens D", ylabel="val loss", title="Chinchilla fit L(N, D)")
    vs_d.legend(fontsize=7)

    largest = max(p["tokens"] for p in points)
    mine = [p for p in points if p["tokens"] == largest]
    vs_n.plot([p["non_embedding"] for p in mine], [p["val_loss"] for p in mine], "o", color="C0")
    if "kaplan" in summary:
        k = summary["kaplan"]
        n = np.array([p["non_embedding"] for p in points if p["tokens"] == k["tokens"]])
        grid = np.geomspace(n.min() / 2, n.max() * 4, 50)
        vs_n.plot(grid, (k["N_c"] / grid) ** k["alpha_N"], "-", color="C0",
                  label=f"(N_c/N)^{k['alpha_N']:.3f}, D = {k['tokens']:,}")
        vs_n.legend(fontsize=8)
    vs_n.set(xscale="log", yscale="log", xlabel="non-embedding parameters", ylabel="val loss", title="Kaplan L(N)")

    if fit is not None:
        flops = np.array([6 * p["parameters"] * p["tokens"] for p in points])
        budgets = np.geomspace(flops.min(), flops.max() * 100, 5)
        best = []
        n_fit = [p["parameters"] for p in points]
        for i, c in enumerate(budgets):
            n = np.geomspace(min(n_fit) / 10, max(n_fit) * 1000, 400)
            loss = fit.predict(n, c / (6 * n))
            iso.plot(n, loss, color=f"C{i}", lw=1, label=f"C = {c:.2g}")
            best.append((n[np.argmin(loss)], loss.min()))
        iso.plot(*zip(*best), "k.--", lw=1, label="compute-optimal N")
        iso.scatter([p["parameters"] for p in points], [p["val_loss"] for p in points], s=10, c="0.4", zorder=3)
        lo = min(p["val_loss"] for p in points)
        iso.set_ylim(min(b[1] for b in best) * 0.95, max(p["val_loss"] for p in points) * 1.2 if lo > 0 else None)
        iso.legend(fontsize=7)
    iso.set(xscale="log", xlabel="parameters N", ylabel="predicted loss", title="iso-FLOP curves (C = 6ND)")
    skipped = summary.get("skipped", {})
    for ax, name in ((vs_d, "chinchilla"), (vs_n, "kaplan"), (iso, "chinchilla")):
        if name not in summary:
            say_skipped(ax, skipped.get(name, "not in the summary"))
    for ax in (curves, vs_d, vs_n, iso):
        ax.grid(True, which="both", alpha=0.3)
    return fig
