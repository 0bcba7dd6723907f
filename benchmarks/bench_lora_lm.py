"""LoRA versus full fine-tuning of the demo decoder (``stdlib-lm``) on tinyshakespeare.

    python benchmarks/bench_lora_lm.py                       # trains the demo decoder first (~4 min)
    python benchmarks/bench_lora_lm.py --base runs/stdlib-lm/best
    python benchmarks/bench_lora_lm.py --demo-steps 20 --steps 20   # smoke

The demo decoder learned Python (the standard library, bytes); both runs adapt it to
Shakespeare for the same steps, batch and schedule: full fine-tuning updates every weight,
LoRA (rank 8 on qkv, out, FFN up and down) only its adapters. Each run is a child process,
so its peak resident memory (``VmHWM``) is its own; the training state (weights, gradients
and AdamW's two moments, fp32) is also given as a count. Needs the shared tinyshakespeare.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("BLOCKFORMER_DATA", REPO.parent / "shared" / "data"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, default=None, help="a trained stdlib-lm checkpoint (default: train one)")
    p.add_argument("--demo-steps", type=int, default=None, help="override stdlib-lm's train.steps")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--full-lr", type=float, default=5e-4)
    p.add_argument("--lora-lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--text", type=Path, default=DATA / "tinyshakespeare" / "input.txt")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-lora-lm")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lora_lm")
    p.add_argument("--child", choices=["full", "lora", "zero-shot"], help=argparse.SUPPRESS)
    return p.parse_args()


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> dict:
    """One fine-tuning run (or the base's zero-shot loss) in this process."""
    import torch  # noqa: PLC0415

    from blockformer.run_config import load_run_config  # noqa: PLC0415
    from blockformer.stats import count_parameters  # noqa: PLC0415
    from blockformer.train import train  # noqa: PLC0415
    from blockformer.train.finetune import build_model_for  # noqa: PLC0415
    from blockformer.train.load import read_config  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    over = [f"data.text={args.text}", "data.max_bytes=none", "data.val_fraction=0.1", "train.progress=false",
            f"train.steps={args.steps}", f"train.eval_every={args.steps}", "train.samples=0", "train.warmup=20",
            "train.eval_batches=40", "train.min_lr=0"]
    if args.child == "lora":
        over += [f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}", "lora.targets=qkv,out,up,down",
                 f"train.lr={args.lora_lr}"]
    else:
        over += [f"train.lr={args.full_lr}"]
    cfg = load_run_config(preset="stdlib-lm", overrides=over)
    cfg = dataclasses.replace(cfg, model=read_config(args.base).model,
                              train=dataclasses.replace(cfg.train, init_from=str(args.base)))
    if args.child == "zero-shot":  # the base's loss on the same validation windows, before any step
        from blockformer.train.setup import build_run  # noqa: PLC0415

        run = build_run(cfg, torch.device("cpu"), log=lambda *a: None)
        return {"val_loss": run.objective.evaluate(run.model, cfg.train)["val_loss"]}
    t0 = time.perf_counter()
    result = train(cfg, args.work / args.child)
    minutes = (time.perf_counter() - t0) / 60
    model = build_model_for(cfg, load_init=False, log=None)
    n_all, n_train = count_parameters(model), count_parameters(model, trainable_only=True)
    return {"val_loss": result.val["val_loss"], "trainable_params": n_train, "total_params": n_all,
            "train_state_mib": 4 * (n_all + 3 * n_train) / 2**20,  # fp32 weights + grads + 2 AdamW moments
            "peak_rss_mib": peak_rss_mib(), "minutes": minutes, "steps": args.steps,
            "first_loss": result.losses[0], "checkpoint_mib": _size_mib(result.checkpoint)}


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20


def main() -> int:
    args = parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    if not args.text.is_file():
        print(f"{args.text}: not found (shared tinyshakespeare data)", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base_minutes = None
    if args.base is None:
        cmd = [sys.executable, "-m", "blockformer", "train", "--preset", "stdlib-lm", "--out", str(args.work / "demo"),
               "--set", "train.progress=false", "--set", "train.samples=0"]
        if args.demo_steps:
            cmd += ["--set", f"train.steps={args.demo_steps}", "--set", f"train.eval_every={args.demo_steps}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=env)
        base_minutes = (time.perf_counter() - t0) / 60
        args.base = args.work / "demo" / "best"
    rows = {}
    for kind in ("zero-shot", "full", "lora"):
        cmd = [sys.executable, __file__, "--child", kind, "--base", str(args.base), "--steps", str(args.steps),
               "--full-lr", str(args.full_lr), "--lora-lr", str(args.lora_lr), "--rank", str(args.rank),
               "--text", str(args.text), "--work", str(args.work)] + (["--threads", str(args.threads)] if args.threads else [])
        out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout
        rows[kind] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        print(kind, rows[kind], flush=True)
    from common import cpu_kind  # noqa: PLC0415

    result = {"base": str(args.base), "base_minutes": base_minutes, "rank": args.rank, "cpu_kind": cpu_kind(),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = [f"CPU {result['cpu_kind']}", "",
             "| run | val loss | trainable parameters | training state (MiB) | peak RSS (MiB) | weights saved (MiB) | minutes |",
             "|---|---|---|---|---|---|---|",
             f"| demo decoder, no fine-tuning | {rows['zero-shot']['val_loss']:.3f} | - | - | - | - | - |"]
    for kind, name in (("full", "full fine-tuning"), ("lora", f"LoRA rank {args.rank}")):
        r = rows[kind]
        table.append(f"| {name} | {r['val_loss']:.3f} | {r['trainable_params']:,} of {r['total_params']:,} | "
                     f"{r['train_state_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['checkpoint_mib']:.2f} | {r['minutes']:.1f} |")
    text = "\n".join(table) + "\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
