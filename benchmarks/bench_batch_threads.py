"""``train.batch_threads``: a training step with each micro-batch's rows split over threads,
against the same trainer with the rows whole, alternated inside one run.

    python benchmarks/bench_batch_threads.py --threads 2                          # char-lm-tiny and stdlib-lm
    python benchmarks/bench_batch_threads.py --threads 2 --precision fp32 --steps 600
    python benchmarks/bench_batch_threads.py --threads 2 --presets char-lm-tiny --set model.dropout=0.1

One ``blockformer.train`` run per preset (its own data: tinyshakespeare for ``char-lm-tiny``,
the standard library for ``stdlib-lm``). Every ``--window`` steps the run switches between
the split step (``RowThreads(threads)``) and the whole one (``RowThreads(1)``), so both see
the same model, data, learning-rate schedule and spells of a shared machine; each window's
time per step is recorded (the first two windows and any that hold an evaluation are left
out) and the medians are compared. The losses of the run are the split/whole mix: they say
the run trained, not which is better (``tests/test_batch_threads.py`` checks the two agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import blockformer.train.loop as loop
from blockformer.parallel.threads import RowThreads
from blockformer.run_config import load_run_config
from blockformer.train import train

from common import cpu_kind

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="char-lm-tiny,stdlib-lm")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads, and shards (default: torch's)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, for every preset")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "batch-threads")
    return p.parse_args()


def alternate(pools: dict[str, RowThreads], window: int) -> dict[str, list[float]]:
    """Wraps the loop's step: every ``window`` steps the run's threads switch between
    ``pools["split"]`` and ``pools["whole"]``; returns the ms per step of each window, by mode."""
    times: dict[str, list[float]] = {"split": [], "whole": []}
    state = {"step": 0, "t0": None, "mode": "whole", "evals": 0}
    step, evaluate = loop._step, loop._evaluate_and_save

    def timed_step(run) -> None:
        if state["step"] % window == 0:
            now = time.perf_counter()
            if state["t0"] is not None and state["step"] >= 3 * window and not state["evals"]:
                times[state["mode"]].append(1000 * (now - state["t0"]) / window)
            state["mode"] = "split" if state["mode"] == "whole" else "whole"
            pools["split"].release()  # the whole step on all of torch's threads
            run.threads, state["t0"], state["evals"] = pools[state["mode"]], time.perf_counter(), 0
        state["step"] += 1
        step(run)

    def counted_evaluate(run) -> None:
        state["evals"] += 1
        evaluate(run)

    loop._step, loop._evaluate_and_save = timed_step, counted_evaluate
    return times


def run_preset(preset: str, args, work: Path) -> dict:
    n = torch.get_num_threads()
    data = [f"data.text={SHAKESPEARE}"] if preset == "char-lm-tiny" else []
    cfg = load_run_config(preset=preset, overrides=[*data, f"train.steps={args.steps}", f"train.precision={args.precision}",
                                                    "train.samples=0", "train.progress=false", "train.device=cpu",
                                                    f"data.cache_dir={work / 'cache'}",
                                                    f"train.eval_every={max(1, args.steps // 3)}", *args.set])
    original = loop._step, loop._evaluate_and_save
    with RowThreads(n) as split_rows, RowThreads(1) as whole_rows:
        times = alternate({"split": split_rows, "whole": whole_rows}, args.window)
        try:
            result = train(cfg, work / preset, log=lambda *a: None)
        finally:
            loop._step, loop._evaluate_and_save = original
    split, whole = statistics.median(times["split"]), statistics.median(times["whole"])
    return {"preset": preset, "threads": n, "precision": args.precision, "steps": args.steps,
            "windows": [len(times["split"]), len(times["whole"])], "split_ms": split, "whole_ms": whole,
            "speedup": whole / split, "val_loss": result.val.get("val_loss")}


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    presets = [p for p in args.presets.split(",") if p]
    if "char-lm-tiny" in presets and not SHAKESPEARE.is_file():
        print(f"tinyshakespeare not found at {SHAKESPEARE}: char-lm-tiny left out", file=sys.stderr)
        presets.remove("char-lm-tiny")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            rows.append(run_preset(preset, args, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    report = {"benchmark": "batch_threads", "cpu_kind": cpu_kind(), "command": " ".join(sys.argv), "overrides": args.set,
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = [f"`train.batch_threads`, split against whole rows, alternated every {args.window} steps"
          f"{' (' + ', '.join(args.set) + ')' if args.set else ''}; "
          f"CPU {report['cpu_kind']} (`{report['command']}`)", "",
          "| preset | threads | precision | steps | windows split/whole | ms/step split | ms/step whole | whole/split |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['preset']} | {r['threads']} | {r['precision']} | {r['steps']} | {r['windows'][0]}/{r['windows'][1]} | "
           f"{r['split_ms']:.2f} | {r['whole_ms']:.2f} | {r['speedup']:.3f} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
