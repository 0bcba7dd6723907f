"""What blockformer's two fp32 training kernels win inside a training step: causal attention
(``csrc/causal_attention.c``) and exact GELU keeping its derivative (``csrc/gelu.c``), each on
and off (``kernels.CAUSAL_TRAINING_KERNEL``, ``kernels.GELU_KERNEL``). One process trains a
preset's model on random tokens (forward, backward, fused AdamW) and switches between the four
settings every ``--steps`` steps, so all see the same model and the same spells of a shared
machine; the median of each setting's windows, in ms per step.

    OMP_NUM_THREADS=1 python benchmarks/bench_training_kernels.py --threads 1 --rows 6    # one shard of the split step
    OMP_NUM_THREADS=2 python benchmarks/bench_training_kernels.py --threads 2             # the whole step
    OMP_NUM_THREADS=2 python benchmarks/bench_training_kernels.py --threads 2 --trainer   # the trainer's own loop
    OMP_NUM_THREADS=2 python benchmarks/bench_training_kernels.py --threads 2 --presets gpt2-small --windows 3 --steps 2

``gpt2-small`` is GPT-2 small's shape with its tanh GELU, 4 rows of 256 tokens (not a preset of
blockformer's; not with ``--trainer``).

``--trainer`` times the trainer itself (``blockformer.train``, the preset as it is, so two threads split
the rows: ``train.batch_threads = "auto"``) on tinyshakespeare where ``../shared/data`` has it (else the
preset's own text), switching between torch's kernels and both of blockformer's every ``--steps`` steps
(windows with an evaluation left out).

Cap the kernels at AVX2 with ``MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import cpu_kind, gpt2_config, report

import blockformer.train.loop as loop
from blockformer import build_model, kernels
from blockformer.run_config import load_run_config
from blockformer.train import train

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"

SETTINGS = {  # name: (attention kernel, GELU kernel)
    "torch's attention and GELU": (False, False),
    "blockformer's attention": (True, False),
    "blockformer's GELU": (False, True),
    "both of blockformer's": (True, True),
}


def step_times(preset: str, rows: int | None, windows: int, steps: int) -> tuple[int, dict[str, list[float]]]:
    """Each setting's ms per step over its windows, for ``preset``'s model at ``rows`` rows."""
    if preset == "gpt2-small":  # GPT-2 small with its tanh GELU, over 256 tokens a row (4 rows unless --rows)
        cfg, rows = dataclasses.replace(gpt2_config(max_len=256), gelu_approximate="tanh"), rows or 4
    else:
        rc = load_run_config(preset=preset, overrides=["model.vocab_size=65"] if preset == "char-lm-tiny" else [])
        cfg, rows = rc.model, rows or rc.train.batch_size
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len + 1))

    def step() -> None:
        out = model(tokens[:, :-1])
        logits = out if torch.is_tensor(out) else out.logits
        F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for w in range(windows * len(SETTINGS)):
        name = list(SETTINGS)[w % len(SETTINGS)]
        kernels.CAUSAL_TRAINING_KERNEL, kernels.GELU_KERNEL = SETTINGS[name]
        step()  # a step to leave the last setting's buffers behind
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times[name].append((time.perf_counter() - start) / steps * 1e3)
    return rows, times


def trainer_times(preset: str, windows: int, steps: int) -> tuple[int, dict[str, list[float]]]:
    """The trainer's ms per step over ``windows`` windows of each setting, torch's and both of blockformer's
    taking turns from the loop's own step (``loop._step``)."""
    names = ["torch's attention and GELU", "both of blockformer's"]
    times: dict[str, list[float]] = {name: [] for name in names}
    state = {"step": 0, "t0": None, "name": names[1], "evals": 0}
    step, evaluate = loop._step, loop._evaluate_and_save

    def timed_step(run) -> None:
        if state["step"] % steps == 0:
            if state["t0"] is not None and state["step"] >= 2 * steps and not state["evals"]:
                times[state["name"]].append(1000 * (time.perf_counter() - state["t0"]) / steps)
            state["name"] = names[1 - names.index(state["name"])]
            kernels.CAUSAL_TRAINING_KERNEL, kernels.GELU_KERNEL = SETTINGS[state["name"]]
            state["t0"], state["evals"] = time.perf_counter(), 0
        state["step"] += 1
        step(run)

    def counted_evaluate(run) -> None:
        state["evals"] += 1
        evaluate(run)

    total = (2 * windows + 2) * steps
    with tempfile.TemporaryDirectory() as work:
        data = [f"data.text={SHAKESPEARE}"] if preset == "char-lm-tiny" and SHAKESPEARE.is_file() else []
        cfg = load_run_config(preset=preset, overrides=[*data, f"train.steps={total}", "train.precision=fp32",
                                                        "train.samples=0", "train.progress=false", "train.device=cpu",
                                                        f"data.cache_dir={Path(work) / 'cache'}",
                                                        f"train.eval_every={total}"])
        loop._step, loop._evaluate_and_save = timed_step, counted_evaluate
        try:
            train(cfg, Path(work) / preset, log=lambda *a: None)
        finally:
            loop._step, loop._evaluate_and_save = step, evaluate
    return cfg.train.batch_size, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="char-lm-tiny,stdlib-lm")
    p.add_argument("--rows", type=int, default=None, help="rows a step (default: the preset's batch)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--windows", type=int, default=10, help="windows a setting")
    p.add_argument("--steps", type=int, default=10, help="steps a window")
    p.add_argument("--trainer", action="store_true", help="time the trainer's loop, torch's kernels against both")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    small = [n for n in ("rows", "threads", "windows", "steps") if getattr(args, n) is not None and getattr(args, n) < 1]
    if small:
        p.error(", ".join("--" + n for n in small) + ": expected at least 1")
    if args.trainer and "gpt2-small" in args.presets.split(","):
        p.error("--presets gpt2-small: not with --trainer (a shape of the benchmark's, not a preset)")
    torch.set_num_threads(args.threads)
    lines = [f"# fp32 training steps with and without blockformer's kernels ({cpu_kind()} CPU, {args.threads} "
             f"thread(s), torch {torch.__version__})", "",
             f"Medians over {args.windows} windows of {args.steps} steps a setting, the settings taking turns.", "",
             "| preset | rows | setting | ms/step | torch's / this |", "|---|---:|---|---:|---:|"]
    if args.trainer:
        lines[0] = lines[0].replace("training steps", "training steps of the trainer (rows split over threads)")
    for preset in args.presets.split(","):
        rows, times = (trainer_times(preset, args.windows, args.steps) if args.trainer
                       else step_times(preset, args.rows, args.windows, args.steps))
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["torch's attention and GELU"]
        lines += [f"| `{preset}` | {rows} | {name} | {ms:.2f} | {base / ms:.3f}x |" for name, ms in medians.items()]
    report(lines, args.out)


if __name__ == "__main__":
    main()
