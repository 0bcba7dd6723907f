"""A scaling sweep: one recipe, a grid of model sizes x token budgets, then the fits.

Every point is the base run config with its size and budget changed by rule: width
``d_model`` and depth ``n_layers`` as given, heads of size 32 (``n_heads = d_model / 32``,
at least 1), ``d_ff`` re-derived from the width, steps = tokens / (batch x seq_len x
grad_accum) with the cosine schedule ending at the last step and warmup at most a tenth of
it. The same data, seed and learning rate everywhere. Each point trains into
``OUT/points/<size>_<tokens>/`` and records ``point.json`` when done; a rerun skips finished
points and resumes an interrupted one from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import TransformerConfig
from ..errors import UsageError
from ..run_config import RunConfig
from ..models import build_model
from ..stats import count_parameters, flops_per_token
from ..train.checkpoint import step_checkpoints
from ..train.load import read_config
from ..train.loop import train
from ..train.tracking import append_tracker
from .fit import INTERVAL_SIZES, chinchilla_problem, fit_chinchilla, fit_kaplan, kaplan_problem

POINT = "point.json"
SUMMARY = "summary.json"
PLOT = "sweep.png"
# The built-in stdlib sweep (~16M training tokens; 11.5 minutes on 2 CPU cores in bf16 with its
# check run, BENCHMARKS.md), and its check run.
DEFAULT_SIZES = "32x2,64x2,128x3,192x4"
DEFAULT_TOKENS = "500k,1M,2M"
DEFAULT_HOLDOUT = "256x4:2M"


@dataclass
class Point:
    size: str  # "WIDTHxLAYERS"
    d_model: int
    n_layers: int
    tokens: int  # training tokens D actually seen
    steps: int
    parameters: int  # N: every parameter
    non_embedding: int  # Kaplan's N
    flops: float  # training FLOPs: flops_per_token x D
    val_loss: float
    run_dir: str


POSITIVE = {"d_model", "n_layers", "tokens", "steps", "parameters", "non_embedding", "flops", "val_loss"}


def read_point(path: Path) -> Point:
    """A finished point from its ``point.json``; a file that is not one (bad JSON, a missing
    or unknown key, a wrong type, a number that is not finite and > 0) is a one-line
    ``UsageError`` naming the file and the field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"{path}: not readable as JSON ({why}); expected a sweep point") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a JSON {type(data).__name__}; expected an object with a sweep point's fields")
    types = {f.name: f.type for f in dataclasses.fields(Point)}
    missing, unknown = [k for k in types if k not in data], [k for k in data if k not in types]
    if missing or unknown:
        what = f"missing {', '.join(missing)}" if missing else f"unknown field {', '.join(map(str, unknown))}"
        raise UsageError(f"{path}: {what}; expected the fields {', '.join(types)}")
    for name, kind in types.items():
        _check_field(path, name, data[name], kind)
    return Point(**data)


def _check_field(path: Path, name: str, value: Any, kind: str) -> None:
    """One field of a point: its JSON type, then finite and > 0 for the counts and the loss."""
    if kind == "int":
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        expected = "a finite number"
    else:
        ok, expected = isinstance(value, str) and value != "", "a non-empty string"
    if ok and name in POSITIVE and not value > 0:
        ok, expected = False, expected + " > 0"
    if not ok:
        raise UsageError(f"{path}: field {name}={json.dumps(value)[:40]}; expected {expected}")


def parse_sizes(text: str, flag: str = "--sizes") -> list[tuple[int, int]]:
    """``"64x2,128x4"`` -> [(64, 2), (128, 4)] (width x layers); errors name ``flag``."""
    sizes = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        m = re.fullmatch(r"(\d+)x(\d+)", item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise UsageError(f"{flag} {text}: {item!r} is not WIDTHxLAYERS, e.g. 128x4")
        sizes.append((int(m.group(1)), int(m.group(2))))
    if not sizes:
        raise UsageError(f"{flag}: expected one or more WIDTHxLAYERS, e.g. 64x2,128x4")
    return sizes


def parse_count(text: str, name: str) -> int:
    """``"500k"``, ``"2M"``, ``"1.5e6"`` -> an integer >= 1."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGbB]?)\s*", text)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}
    try:
        value = float(m.group(1)) * scale[m.group(2).lower()] if m else -1
    except ValueError:
        value = -1
    if value < 1:
        raise UsageError(f"{name} {text}: expected a count such as 500k, 2M or 1e6")
    return int(value)


def parse_tokens(text: str) -> list[int]:
    return [parse_count(t, "--tokens") for t in text.split(",") if t.strip()]


def point_name(width: int, layers: int, tokens: int) -> str:
    return f"{width}x{layers}_{_short(tokens)}"


def _short(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


def point_config(base: RunConfig, width: int, layers: int, tokens: int) -> RunConfig:
    """``base`` scaled to one point of the grid (see the module docstring)."""
    model = base.model.to_dict()
    heads = max(1, width // 32) if width % 32 == 0 else 1
    model.update(d_model=width, n_layers=layers, n_heads=heads, n_kv_heads=None, d_ff=None,
                 expert_d_ff=None, scale_embeddings=None)
    tc = base.train
    per_step = tc.batch_size * base.data.seq_len * tc.grad_accum
    steps = max(1, round(tokens / per_step))
    train = dataclasses.replace(tc, steps=steps, warmup=min(tc.warmup, steps // 10), eval_every=0, samples=0,
                                keep_last=1, progress=False, name=point_name(width, layers, tokens))
    return RunConfig(model=TransformerConfig(**model), data=base.data, train=train)


def run_point(cfg: RunConfig, run_dir: Path, log: Callable[[str], None]) -> Point:
    """Train one point (or resume it), and record it in ``run_dir/point.json``."""
    import torch  # noqa: PLC0415

    resume = run_dir if step_checkpoints(run_dir) else None
    result = train(cfg, run_dir, resume=resume, log=log)
    if result.interrupted:
        raise KeyboardInterrupt
    m = read_config(result.checkpoint).model  # vocab_size set from the tokenizer
    with torch.device("meta"):
        model = build_model(m)
    tokens = cfg.train.steps * cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum
    point = Point(
        size=f"{m.d_model}x{m.n_layers}", d_model=m.d_model, n_layers=m.n_layers, tokens=tokens,
        steps=cfg.train.steps, parameters=count_parameters(model),
        non_embedding=count_parameters(model, exclude_embeddings=True),
        flops=flops_per_token(m, cfg.data.seq_len) * tokens, val_loss=result.val["val_loss"], run_dir=str(run_dir),
    )
    (run_dir / POINT).write_text(json.dumps(dataclasses.asdict(point), indent=2) + "\n")
    with append_tracker(run_dir, cfg.train.report_to) as tracker:  # sweep/val_loss, sweep/parameters, ...
        tracker.write({"split": "sweep", "step": point.steps, **dataclasses.asdict(point)})
    return point


def run_grid(
    base: RunConfig, sizes: list[tuple[int, int]], tokens: list[int], out: Path, log: Callable[[str], None] = print
) -> list[Point]:
    """Every (size, budget) point, smallest first; finished points are read, not retrained."""
    points = []
    for width, layers in sorted(sizes, key=lambda s: s[0] ** 2 * s[1]):
        for budget in sorted(tokens):
            points.append(ensure_point(base, width, layers, budget, out / "points", log))
    return points


def ensure_point(base: RunConfig, width: int, layers: int, budget: int, where: Path,
                 log: Callable[[str], None]) -> Point:
    run_dir = where / point_name(width, layers, budget)
    if (run_dir / POINT).is_file():
        point = read_point(run_dir / POINT)
        log(f"{run_dir.name}: done before (val loss {point.val_loss:.4f}), not retrained")
        return point
    cfg = point_config(base, width, layers, budget)
    log(f"{run_dir.name}: {cfg.train.steps} steps")
    point = run_point(cfg, run_dir, log=lambda *a: None)
    log(f"{run_dir.name}: val loss {point.val_loss:.4f}, N = {point.parameters:,}, D = {point.tokens:,}")
    return point


def fit_points(points: list[Point], *, bootstrap: int = 100, budget: float | None = None) -> dict[str, Any]:
    """The Chinchilla fit, Kaplan's L(N) on the largest budget's points, and the compute-optimal
    N and D for ``budget`` FLOPs (default: 10x the largest run). A fit the points cannot
    support (``fit.chinchilla_problem``, ``fit.kaplan_problem``) is skipped, and
    ``summary["skipped"]`` says why: the plot and the report show that instead of a curve."""

    out: dict[str, Any] = {"points": [dataclasses.asdict(p) for p in points], "notes": [], "skipped": {}}
    N, D = [p.parameters for p in points], [p.tokens for p in points]
    if (why := chinchilla_problem(N, D)) is None:
        fit = fit_chinchilla(N, D, [p.val_loss for p in points], bootstrap=bootstrap)
        out["chinchilla"] = fit.to_dict()
        budget = budget or 10 * max(6 * p.parameters * p.tokens for p in points)
        n_opt, d_opt = fit.compute_optimal(budget)
        out["compute_optimal"] = {"flops": budget, "N": n_opt, "D": d_opt, "loss": float(fit.predict(n_opt, d_opt))}
    else:
        out["skipped"]["chinchilla"] = why
        out["notes"].append(f"Chinchilla fit skipped: {why}")
    largest = max(p.tokens for p in points)
    at_largest = [p for p in points if p.tokens == largest]
    if (why := kaplan_problem([p.non_embedding for p in at_largest])) is None:
        kaplan = fit_kaplan([p.non_embedding for p in at_largest], [p.val_loss for p in at_largest],
                            bootstrap=bootstrap)
        out["kaplan"] = {**kaplan.to_dict(), "tokens": largest}
        if kaplan.interval is None and bootstrap:
            out["notes"].append(f"Kaplan interval not given: {len(at_largest)} sizes; a bootstrap through "
                                f"fewer than {INTERVAL_SIZES} covers far below its nominal 95%")
    else:
        out["skipped"]["kaplan"] = f"{why} (at the largest budget, D = {largest:,})"
        out["notes"].append(f"Kaplan fit skipped: {out['skipped']['kaplan']}")
    return out


def report(summary: dict[str, Any]) -> str:
    """The fitted constants, intervals and the compute-optimal split, as text."""
    lines = []
    if "chinchilla" in summary:
        c = summary["chinchilla"]
        lines.append("Chinchilla  L(N, D) = E + A / N^alpha + B / D^beta   (95% parametric bootstrap intervals)")
        for p in ("E", "A", "B", "alpha", "beta"):
            lo, hi = c["intervals"].get(p, (math.nan, math.nan))
            lines.append(f"  {p:<6} {c[p]:>12.4g}   [{lo:.4g}, {hi:.4g}]")
        o = summary["compute_optimal"]
        lines.append(f"compute-optimal at C = {o['flops']:.3g} FLOPs: N = {o['N']:.3g}, D = {o['D']:.3g} tokens "
                     f"(D/N = {o['D'] / o['N']:.3g}), predicted loss {o['loss']:.4f}")
    if "kaplan" in summary:
        k = summary["kaplan"]
        interval = f"   [{k['interval'][0]:.4g}, {k['interval'][1]:.4g}]" if k.get("interval") else ""
        lines.append(f"Kaplan      L(N) = (N_c / N)^alpha_N at D = {k['tokens']:,}: alpha_N = {k['alpha_N']:.4g}"
                     f"{interval}, N_c = {k['N_c']:.4g}")
    if "predicted" in summary.get("holdout", {}):
        h = summary["holdout"]
        lines.append(f"check       {h['size']} at D = {h['tokens']:,} (not in the fit): measured {h['val_loss']:.4f}, "
                     f"predicted {h['predicted']:.4f} ({100 * (h['predicted'] / h['val_loss'] - 1):+.1f}%)")
    lines += [f"note        {n}" for n in summary.get("notes", [])]
    return "\n".join(lines)


def save(summary: dict[str, Any], out: Path) -> Path:
    path = out / SUMMARY
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path
