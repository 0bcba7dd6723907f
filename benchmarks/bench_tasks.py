"""Synthetic tasks: train each preset, then report exact match on its whole held-out split.

    python benchmarks/bench_tasks.py                                   # copy, sort, add at their presets
    python benchmarks/bench_tasks.py --tasks copy --steps 20 --heldout 20   # smoke

Targets (issue 3): ``copy`` and ``sort`` 100% exact match on held-out sources never seen in
training; ``add`` (3-digit operands) >= 99%. Decoding is greedy. Figures go to ``--out`` as
JSON and as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockformer.run_config import load_run_config
from blockformer.train import load_checkpoint, train
from blockformer.train.objective import translate_greedy
from blockformer.train.setup import make_task_for

from common import cpu_kind

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"copy": 1.0, "reverse": 1.0, "sort": 1.0, "add": 0.99}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="copy,sort,add", help="comma-separated: copy, reverse, sort, add")
    p.add_argument("--steps", type=int, default=None, help="override every preset's train.steps")
    p.add_argument("--heldout", type=int, default=None, help="override data.heldout (default: the preset's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tasks")
    return p.parse_args()


def run_task(name: str, args: argparse.Namespace, work: Path) -> dict:
    overrides = [*args.overrides, "train.samples=0"]
    if args.steps is not None:
        overrides += [f"train.steps={args.steps}", f"train.eval_every={max(1, args.steps // 4)}"]
    if args.heldout is not None:
        overrides += [f"data.heldout={args.heldout}", f"train.eval_samples={args.heldout}"]
    cfg = load_run_config(preset=name, overrides=overrides)
    t0 = time.perf_counter()
    result = train(cfg, work / name)
    wall = time.perf_counter() - t0
    ckpt = load_checkpoint(result.best or result.checkpoint)
    pairs = make_task_for(cfg.data).heldout()
    outputs = translate_greedy(ckpt.model, ckpt.tokenizer, [s for s, _ in pairs], batch_size=256)
    correct = sum(o == t for o, (_, t) in zip(outputs, pairs))
    wrong = [(s, o, t) for o, (s, t) in zip(outputs, pairs) if o != t][:5]
    return {"task": name, "steps": cfg.train.steps, "heldout": len(pairs),
            "exact_match": correct / len(pairs), "target": TARGETS[name],
            "val_loss": result.val.get("val_loss"), "wall_s": wall,
            "examples_wrong": wrong}


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in tasks:
            rows.append(run_task(name, args, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    report = {"benchmark": "synthetic tasks", "threads": torch.get_num_threads(), "cpu_kind": cpu_kind(),
              "command": " ".join(sys.argv), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = [f"Synthetic tasks, greedy decoding on the held-out split, {report['threads']} threads, "
          f"CPU {report['cpu_kind']} (`{report['command']}`)", "",
          "| task | steps | held-out | exact match | target | train time |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['task']} | {r['steps']} | {r['heldout']} | {100 * r['exact_match']:.1f}% | "
                  f">= {100 * r['target']:.0f}% | {r['wall_s']:.0f} s |")
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["exact_match"] >= r["target"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
