"""What normalisation controls: the scale of the residual stream through depth.

The RMS of each block's output, for the same variants as ``gradients``. Post-Norm ends
every block with a norm, so every output has RMS 1 exactly (gamma=1, beta=0 at init).
Pre-Norm normalises only each sublayer's *input*; the stream itself is a running sum that
may grow with depth and with training, and the final norm rescales it once. Without
normalisation the scale is whatever the weights make it: without residuals too it
shrinks geometrically to zero.
"""

from __future__ import annotations

import math
from typing import Any

from .report import ProbeResult, log_ratio_axes
from .variants import VARIANTS, measure_profiles, ratio


def run(
    depths: str | list[int] = "8,16,32,64",
    variants: str | list[str] = ",".join(VARIANTS),
    steps: int = 200,
    train_depth: int = 16,
    lr: float = 1e-3,
    warmup: int = 50,
    d_model: int = 32,
    seed: int = 0,
) -> ProbeResult:
    """Per-block output RMS; the table shows the last block's RMS and last / first."""
    prof = measure_profiles(depths, variants, steps=steps, train_depth=train_depth, lr=lr, warmup=warmup,
                            d_model=d_model, seed=seed)
    depths, variants = prof["depths"], prof["variants"]
    rows, data = [], {"depths": depths, "train_depth": train_depth, "steps": steps, "variants": {}}
    for v in variants:
        init = {d: prof["init"][v][d]["rms"] for d in depths}
        entry: dict[str, Any] = {"label": VARIANTS[v][0], "init": init,
                                 "init_growth": {d: ratio(r[-1], r[0]) for d, r in init.items()}}
        for d in depths:
            rows.append([VARIANTS[v][0], d, "init", init[d][0], init[d][-1], entry["init_growth"][d],
                         ratio(max(init[d]), min(init[d]))])
        if steps > 0:
            r = prof["trained"][v]["rms"]
            entry.update(trained=r, trained_growth=ratio(r[-1], r[0]))
            rows.append([VARIANTS[v][0], train_depth, f"{steps} steps", r[0], r[-1], entry["trained_growth"],
                         ratio(max(r), min(r))])
        data["variants"][v] = entry
    return ProbeResult(
        name="scale",
        claim="normalisation keeps the residual stream's scale bounded through depth; without it the "
        "scale drifts, and without residuals it collapses",
        columns=["variant", "blocks", "when", "RMS block 1", "RMS last block", "last / first", "max / min"],
        rows=rows,
        data=data,
        notes=[
            "RMS of each block's output (the residual stream it hands on), on one fixed batch.",
            "Post-Norm: exactly 1 everywhere at init. Pre-Norm: near 1 (unit-scale embeddings) and "
            "flat at init because the branch outputs are scaled by 1/sqrt(2 * depth) (GPT-2 init).",
            "max / min near 1 means bounded; a last / first near 0 means the signal collapsed.",
        ],
        plotter=plot,
    )


def plot(result: ProbeResult, fig: Any) -> None:
    """RMS per block for the deepest stack at init, and after training."""
    data = result.data
    trained = data["steps"] > 0
    axes = fig.subplots(1, 2 if trained else 1, squeeze=False)[0]
    deepest = max(data["depths"])
    for entry in data["variants"].values():
        profiles = [entry["init"][deepest]] + ([entry["trained"]] if trained else [])
        for ax, profile in zip(axes, profiles):
            drawable = [r if r > 0 else math.nan for r in profile]  # log axes: leave 0 out
            ax.plot(range(1, len(profile) + 1), drawable, label=entry["label"])
    log_ratio_axes(axes[0], f"block output RMS, {deepest} blocks, at init", "block (1 = input side)", "RMS")
    if trained:
        log_ratio_axes(axes[1], f"after {data['steps']} steps, {data['train_depth']} blocks",
                       "block (1 = input side)", "RMS")
    axes[0].legend(fontsize=7)
