"""How fast `blockformer view` answers, measured through its own HTTP API in process
(FastAPI's TestClient: the server's work and its JSON, not a browser's drawing):

- the attention page's request for a text on the demo model's shape (stdlib-lm: 4 layers,
  d_model 192, 6 heads, rope, byte tokenizer; random weights), at the demo's own
  ``max_seq_len`` of 128 bytes and, with the context raised to 256, at 256;
- the runs page with 50 runs of 10,000 metric lines each: the list, a run's first poll
  (all its lines) and a poll with nothing new.

    python benchmarks/bench_view.py --threads 2 --out benchmarks/results/view.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockformer.config import TransformerConfig
from blockformer.models import build_model
from blockformer.run_config import RunConfig
from blockformer.tokenizers import train_tokenizer
from blockformer.train.checkpoint import save_checkpoint

from common import cpu_kind


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up: the checkpoint loads once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def demo_run(root: Path, name: str, context: int) -> None:
    tok = train_tokenizer("byte", ["x"])
    cfg = RunConfig(model=TransformerConfig(arch="decoder", vocab_size=tok.vocab_size, d_model=192, n_layers=4,
                                            n_heads=6, max_seq_len=context, position="rope"))
    run = root / name
    run.mkdir(parents=True)
    (run / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    save_checkpoint(run / "step-000001", build_model(cfg.model, seed=0), tok, cfg)
    os.symlink("step-000001", run / "best")


def metric_runs(root: Path, n_runs: int, n_lines: int) -> None:
    for r in range(n_runs):
        run = root / f"run-{r:02d}"
        run.mkdir(parents=True)
        lines = [json.dumps({"split": "train", "step": s, "loss": 4.0 / s, "lr": 1e-3, "tokens_per_s": 1e4})
                 for s in range(1, n_lines + 1)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fastapi.testclient import TestClient  # noqa: PLC0415

    from blockformer.view.app import create_app  # noqa: PLC0415

    text = ("def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n" * 4)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        demo_run(root / "attention", "demo-128", 128)
        demo_run(root / "attention", "demo-256", 256)
        client = TestClient(create_app(root / "attention"))
        for name, n in (("demo-128", 128), ("demo-256", 256)):
            body = {"checkpoint": f"{name}/best", "text": text[:n]}
            answer = client.post("/api/attention", json=body)
            assert answer.status_code == 200, answer.text
            s = median_s(lambda: client.post("/api/attention", json=body), args.repeats)
            rows.append((f"attention, {n}-byte text ({name}: demo shape, context {name[5:]})", s, len(answer.content)))
        metric_runs(root / "many", 50, 10_000)
        client = TestClient(create_app(root / "many"))
        rows.append(("runs list, 50 runs x 10,000 lines", median_s(lambda: client.get("/api/runs"), args.repeats),
                     len(client.get("/api/runs").content)))
        first = client.get("/api/metrics", params={"run": "run-07"})
        cursor = first.json()["cursor"]
        rows.append(("a run's first poll (10,000 lines)",
                     median_s(lambda: client.get("/api/metrics", params={"run": "run-07"}), args.repeats),
                     len(first.content)))
        rows.append(("a poll with nothing new",
                     median_s(lambda: client.get("/api/metrics", params={"run": "run-07", "cursor": cursor}),
                              args.repeats), None))
    lines = [f"# blockformer view: answer times ({cpu_kind()} CPU, {args.threads} threads, torch {torch.__version__}, "
             f"median of {args.repeats})", "", "| request | median (s) | answer size |", "|---|---:|---:|"]
    for what, s, size in rows:
        lines.append(f"| {what} | {s:.3f} | {'' if size is None else f'{size / 1e6:.2f} MB'} |")
    text_out = "\n".join(lines) + "\n"
    print(text_out)
    if args.out:
        Path(args.out).write_text(text_out, encoding="utf-8")


if __name__ == "__main__":
    main()
