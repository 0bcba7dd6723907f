"""``blockformer average``: the mean of several checkpoints' weights, as a new checkpoint.

    blockformer average --checkpoints runs/m30k/step-002000 runs/m30k/step-002250 --output runs/m30k/avg
    blockformer average --run runs/m30k --last 5 --output runs/m30k/avg5

Vaswani et al. (2017) average the last 5 checkpoints of the base model. The trainer keeps
``train.keep_last`` step checkpoints, one every ``train.eval_every`` steps.
"""

from __future__ import annotations

import argparse

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("e.g. blockformer average --run runs/translate-small --last 5 --output runs/translate-small/avg5 "
                     "(the run must keep them: train.keep_last >= 5)")
    parser.add_argument("--checkpoints", nargs="+", metavar="DIR", help="the checkpoints to average")
    parser.add_argument("--run", metavar="DIR", help="a run directory: average its --last N step checkpoints")
    parser.add_argument("--last", type=int, metavar="N", help="with --run: how many of the latest checkpoints (e.g. 5)")
    parser.add_argument("--output", required=True, metavar="DIR", help="the new checkpoint directory")


def run(args: argparse.Namespace) -> int:
    from ..train.average import average_checkpoints, last_checkpoints  # noqa: PLC0415

    if args.checkpoints and (args.run or args.last is not None):
        raise UsageError("--checkpoints: give either --checkpoints D1 D2 ... or --run DIR --last N, not both")
    if args.checkpoints:
        paths = args.checkpoints
    elif args.run and args.last is not None:
        paths = last_checkpoints(args.run, args.last)
    else:
        raise UsageError("--checkpoints: missing; expected --checkpoints D1 D2 ... or --run DIR --last N")
    out = average_checkpoints(paths, args.output)
    print(f"averaged {len(paths)} checkpoints -> {out}")
    for p in paths:
        print(f"  {p}")
    return 0
