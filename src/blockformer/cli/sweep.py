"""``blockformer sweep --preset NAME [--sizes WxL,...] [--tokens D,...] [--out DIR]``

Train a grid of model sizes x token budgets with one recipe, fit Chinchilla's L(N, D) and
Kaplan's L(N), print the constants and the compute-optimal split of a budget, and draw
``sweep.png``. Rerunning the same command resumes: finished points are not retrained.
Without --sizes/--tokens on the stdlib-lm preset it runs the built-in small sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ..errors import UsageError
from ..run_config import load_run_config, preset_names
from ..scaling.sweep import DEFAULT_HOLDOUT, DEFAULT_SIZES, DEFAULT_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[1].strip()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", nargs="?", metavar="CONFIG.toml", help="a TOML run config (the recipe)")
    parser.add_argument("--preset", metavar="NAME", help="the recipe: " + ", ".join(preset_names()))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"WIDTHxLAYERS,... (default: {DEFAULT_SIZES})")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"training tokens per run (default: {DEFAULT_TOKENS})")
    parser.add_argument("--holdout", default=DEFAULT_HOLDOUT, metavar="WxL:TOKENS",
                        help="one more run, left out of the fit, to check its prediction ('' = none; "
                        f"default: {DEFAULT_HOLDOUT})")
    parser.add_argument("--budget", type=float, default=None, metavar="FLOPS",
                        help="compute budget for the optimal N and D (default: 10x the largest run)")
    parser.add_argument("--bootstrap", type=int, default=100, help="bootstrap resamples for the intervals")
    parser.add_argument("--out", metavar="DIR", help="sweep directory (default: runs/sweep-<train.name>)")
    parser.add_argument("--fit-only", action="store_true", help="fit and plot the finished points; train nothing")


def run(args: argparse.Namespace) -> int:
    from ..scaling.plot import plot_sweep  # noqa: PLC0415
    from ..scaling.sweep import (  # noqa: PLC0415
        POINT, PLOT, ensure_point, fit_points, parse_count, parse_sizes, parse_tokens, point_name, read_point,
        report, run_grid, save,
    )

    base = load_run_config(args.config, args.preset, args.overrides)
    if base.data.kind != "text":
        raise UsageError("sweep: expected a language-modelling recipe (data.text); "
                         f"this one trains on {base.data.kind}")
    sizes, tokens = parse_sizes(args.sizes), parse_tokens(args.tokens)
    if args.bootstrap < 0:
        raise UsageError(f"--bootstrap {args.bootstrap}: expected an integer >= 0")
    if args.budget is not None and not 0 < args.budget < float("inf"):
        raise UsageError(f"--budget {args.budget}: expected a finite number of FLOPs > 0")
    holdout = None  # parsed before any training: a typo must not cost a sweep
    if args.holdout:
        size, sep, budget = args.holdout.partition(":")
        if not sep:
            raise UsageError(f"--holdout {args.holdout}: expected WIDTHxLAYERS:TOKENS, e.g. 256x4:2M")
        sizes_out = parse_sizes(size, "--holdout")
        if len(sizes_out) != 1:
            raise UsageError(f"--holdout {args.holdout}: expected one WIDTHxLAYERS before the colon")
        holdout = (*sizes_out[0], parse_count(budget, "--holdout"))
    out = Path(args.out) if args.out else Path("runs") / f"sweep-{base.train.name}"
    out.mkdir(parents=True, exist_ok=True)
    if args.fit_only:
        points = [read_point(f) for f in sorted((out / "points").glob(f"*/{POINT}"))]
        if not points:
            raise UsageError(f"--fit-only: no finished points in {out / 'points'}")
    else:
        print(f"sweep: {len(sizes)} sizes x {len(tokens)} budgets -> {out}")
        points = run_grid(base, sizes, tokens, out)
    summary = fit_points(points, bootstrap=args.bootstrap, budget=args.budget)
    check = None
    if holdout is not None:
        width, layers, budget = holdout
        done = (out / "holdout" / point_name(width, layers, budget) / POINT).is_file()
        if done or not args.fit_only:
            check = ensure_point(base, width, layers, budget, out / "holdout", print)
    if check is not None:
        summary["holdout"] = dataclasses.asdict(check)
        if "chinchilla" in summary:
            from ..scaling.fit import ChinchillaFit  # noqa: PLC0415

            c = summary["chinchilla"]
            fit = ChinchillaFit(**{k: c[k] for k in ("E", "A", "B", "alpha", "beta", "objective")})
            summary["holdout"]["predicted"] = float(fit.predict(check.parameters, check.tokens))
        else:
            summary["notes"].append("holdout run not compared: no Chinchilla fit")
    save(summary, out)
    print(report(summary))
    print(f"wrote {plot_sweep(summary, out / PLOT)} and {out / 'summary.json'}")
    return 0
