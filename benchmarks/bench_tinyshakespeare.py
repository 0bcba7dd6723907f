"""tinyshakespeare with nanoGPT's CPU shape (the ``char-lm-tiny`` preset), against a plain
PyTorch training loop of the same shape timed in the same run.

    python benchmarks/bench_tinyshakespeare.py                     # 2000 steps, fp32 and bf16
    python benchmarks/bench_tinyshakespeare.py --compile           # also both compiled
    python benchmarks/bench_tinyshakespeare.py --steps 20 --reference-steps 10 --precisions fp32   # smoke

blockformer trains the preset (4 layers, 4 heads, width 128, context 64, batch 12, dropout 0,
lr 1e-3 warmup + cosine to 1e-4, 90/10 split) for ``--steps`` steps per precision and reports
the final validation loss over the whole validation split (target: <= 1.88, nanoGPT's figure
for this shape), training tokens/s and MFU against this machine's measured matmul peak. The
reference is nanoGPT's model and loop written out in plain PyTorch (LayerNorm without bias,
learned positions, GELU MLP, tied head, fused attention, AdamW with the same decay groups),
trained on the same tokens for ``--reference-steps`` steps in windows of ``train.log_every``
steps that take turns with the trainer's own windows in the same process (one after every
second of the trainer's at the defaults), so that a slow spell of a shared
machine falls on both. Each side's statistic is the median of its windows' tokens/s; the
ratio of the two medians is the figure, and the quartiles of the ratios of each plain window
to the trainer's window just before it say how far this run's noise moves it. ``--compile``
adds both compiled (``train.compile=true``; the reference under ``torch.compile``), each
against the other in the same mode. Figures go to ``--out`` as JSON and as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import blockformer.train.loop as loop
from blockformer.data.token_file import TokenFile
from blockformer.run_config import load_run_config
from blockformer.train import train
from blockformer.train.metrics import read_metrics
from blockformer.precision import autocast

from common import cpu_kind

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--reference-steps", type=int, default=1000, help="steps timed for the plain PyTorch loop")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--compile", action="store_true", help="also time both compiled")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tinyshakespeare")
    return p.parse_args()


# ---------------------------------------------------------------------- the reference
class RefBlock(nn.Module):
    """nanoGPT's block: x + attn(ln(x)), x + mlp(ln(x)); no biases."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_layers: int, n_heads: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(RefBlock(d, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Reference:
    """The plain loop (forward, loss, backward, clip, AdamW step) on ``tokens``, built and warmed
    up at once; ``window(n)`` trains ``n`` more steps and returns their tokens/s (``compile``: the
    model under ``torch.compile``, as nanoGPT's ``--compile``). It draws its batches from a
    generator of its own, so running it between the trainer's steps changes nothing there."""

    def __init__(self, tokens: np.ndarray, cfg, precision: str, compile: bool = False) -> None:
        m, t = cfg.model, cfg.train
        torch.manual_seed(0)
        self.model = RefGPT(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len)
        self.forward = torch.compile(self.model) if compile else self.model
        decay = [p for p in self.model.parameters() if p.dim() >= 2 and p is not self.model.wte.weight]
        rest = [p for p in self.model.parameters() if p.dim() < 2 or p is self.model.wte.weight]
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))
        self.B, self.T, self.clip, self.precision = t.batch_size, cfg.data.seq_len, t.grad_clip, precision
        self.data = torch.from_numpy(tokens.astype(np.int64))
        self.g = torch.Generator().manual_seed(0)
        for _ in range(10):  # warm-up (and compilation)
            self.step()

    def step(self) -> None:
        ix = torch.randint(len(self.data) - self.T - 1, (self.B,), generator=self.g)
        x = torch.stack([self.data[i : i + self.T] for i in ix])
        y = torch.stack([self.data[i + 1 : i + self.T + 1] for i in ix])
        with autocast(self.precision, torch.device("cpu")):
            logits = self.forward(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def window(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return steps * self.B * self.T / (time.perf_counter() - t0)


# ---------------------------------------------------------------------- blockformer
def blockformer_run(data: Path, steps: int, precision: str, work: Path, compile: bool = False,
                    reference_steps: int = 0) -> dict:
    """blockformer's trainer for ``steps`` steps; with ``reference_steps``, the plain loop of the
    same precision and mode runs windows of ``train.log_every`` steps between the trainer's log
    windows (``reference_steps`` in all, spread evenly over the run), so that both sides see the
    same spells of a shared machine. The trainer's windows leave the plain loop's
    time out, as they leave out its evaluations."""
    cfg = load_run_config(preset="char-lm-tiny", overrides=[
        f"data.text={data}", f"train.steps={steps}", f"train.precision={precision}", "train.device=cpu",
        f"data.cache_dir={work / 'cache'}", f"train.eval_every={max(1, steps // 4)}", "train.samples=0",
        f"train.compile={str(compile).lower()}",
    ])
    window = cfg.train.log_every
    n = steps // window  # the trainer's windows; the plain loop's, at least one if asked for:
    k = min(max(1, reference_steps // window), n) if reference_steps else 0
    reference: list[Reference] = []
    rates: list[tuple[int, float]] = []  # (the trainer's step before it, the plain loop's tokens/s)
    log = loop._log

    def interleaved(run) -> None:
        log(run)
        i = run.step // window  # the trainer's windows so far; the plain loop's so far: i * k // n
        if not k or run.step % window or i * k // n == (i - 1) * k // n:
            return
        with run.threads.all_threads(), torch.random.fork_rng(devices=[]):  # torch's stream stays the trainer's
            if not reference:  # the token cache exists from the trainer's start on
                cache = sorted((work / "cache").glob("tokens-*.bin"))[0]
                reference.append(Reference(np.asarray(TokenFile(cache).tokens), cfg, precision, compile))
            rates.append((run.step, reference[0].window(window)))
        run.window.t0 = time.perf_counter()

    loop._log = interleaved
    t0 = time.perf_counter()
    try:
        result = train(cfg, work / f"run-{precision}-{'compiled' if compile else 'eager'}")
    finally:
        loop._log = log
    wall = time.perf_counter() - t0
    records = [r for r in read_metrics(result.run_dir) if r["split"] == "train"]
    steady = records[1:] or records  # the first interval includes start-up (and compilation)
    ours = {r["step"]: r["tokens_per_s"] for r in steady}
    paired = [ours[s] / rate for s, rate in rates if s in ours]  # the trainer's window just before each
    return {"val_loss": result.val["val_loss"], "full_val_loss": full_val_loss(result.checkpoint, cfg, precision),
            "tokens_per_s": float(np.median(list(ours.values()))),
            "mfu": float(np.median([r.get("mfu", float("nan")) for r in steady])), "wall_s": wall,
            "reference_tokens_per_s": float(np.median([r for _, r in rates])) if rates else float("nan"),
            "reference_windows": len(rates),
            "paired_ratio_quartiles": [float(q) for q in np.percentile(paired, [25, 50, 75])] if paired else [],
            "config": cfg, "run_dir": str(result.run_dir)}


@torch.no_grad()
def full_val_loss(checkpoint: Path, cfg, precision: str) -> float:
    """Mean loss per token over every window of the validation split (not ``eval_batches``)."""
    from blockformer.data.lm import LMDataset  # noqa: PLC0415
    from blockformer.train.load import load_checkpoint  # noqa: PLC0415
    from blockformer.nn.loss import token_loss  # noqa: PLC0415

    model = load_checkpoint(checkpoint).model.eval()
    cache = sorted(Path(cfg.data.cache_dir).glob("tokens-*.bin"))[0]
    val = LMDataset(TokenFile(cache), cfg.data.seq_len, "val", cfg.data.val_fraction)
    total, count = 0.0, 0
    for x, y in val.eval_batches(64):
        with autocast(precision, torch.device("cpu")):
            total += float(token_loss(model(x), y))
        count += y.numel()
    return total / count


def main() -> int:
    args = parse_args()
    if not args.data.is_file():
        print(f"tinyshakespeare not found at {args.data}; pass --data", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for precision in precisions:
            for compile in (False, True) if args.compile else (False,):
                run = blockformer_run(args.data, args.steps, precision, work, compile, args.reference_steps)
                same = run["reference_tokens_per_s"]
                rows.append({
                    "precision": precision, "mode": "compiled" if compile else "eager", "steps": args.steps,
                    "val_loss": run["val_loss"], "full_val_loss": run["full_val_loss"],
                    "tokens_per_s": run["tokens_per_s"], "mfu": run["mfu"], "reference_tokens_per_s": same,
                    "reference_windows": run["reference_windows"], "ratio_vs_reference": run["tokens_per_s"] / same,
                    "paired_ratio_quartiles": run["paired_ratio_quartiles"],
                    "wall_s": run["wall_s"],
                })
                print(json.dumps(rows[-1]), flush=True)
    baseline = next((r["reference_tokens_per_s"] for r in rows if (r["precision"], r["mode"]) == ("fp32", "eager")),
                    float("nan"))  # nanoGPT as it runs on a CPU: every row is also set against it
    for r in rows:
        r["ratio_vs_fp32_eager_reference"] = r["tokens_per_s"] / baseline
    report = {"benchmark": "tinyshakespeare char-lm-tiny", "threads": torch.get_num_threads(), "cpu_kind": cpu_kind(),
              "target_val_loss": 1.88, "command": " ".join(sys.argv), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = [f"tinyshakespeare, `char-lm-tiny` shape, {args.steps} steps, {report['threads']} threads, "
          f"CPU {report['cpu_kind']} (`{report['command']}`)", "",
          "| precision | mode | val loss, whole split (target <= 1.88) | tokens/s | MFU | "
          "plain PyTorch tokens/s (same precision and mode; its windows) | ratio | window pairs' ratios "
          "(quartiles) | ratio vs plain PyTorch fp32 eager |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["paired_ratio_quartiles"]
        pairs = f"{q[0]:.2f} / **{q[1]:.2f}** / {q[2]:.2f}" if q else "-"
        md.append(f"| {r['precision']} | {r['mode']} | {r['full_val_loss']:.3f} | {r['tokens_per_s']:,.0f} | "
                  f"{100 * r['mfu']:.1f}% | {r['reference_tokens_per_s']:,.0f} ({r['reference_windows']}) | "
                  f"{r['ratio_vs_reference']:.2f} | {pairs} | {r['ratio_vs_fp32_eager_reference']:.2f} |")
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    ok = all(r["full_val_loss"] <= 1.88 for r in rows) or args.steps < 2000
    return 0 if ok and all(math.isfinite(r["full_val_loss"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
