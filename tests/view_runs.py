"""A runs folder for the view's tests: tiny random checkpoints of each architecture and
``metrics.jsonl`` files as the trainer writes them (whole, torn, corrupt, still written)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from blockformer.config import TransformerConfig
from blockformer.models import build_model
from blockformer.run_config import RunConfig
from blockformer.tokenizers import train_tokenizer
from blockformer.train.checkpoint import save_checkpoint

TEXT = "the cat sat on the mat. a dog ran far."
SHORT = "the cat sat on the mat."  # what the pages' tests type


def records(n: int, lr: float = 1e-3) -> list[dict]:
    """Train records every step and a validation record every 5, as the loop writes them."""
    out = []
    for step in range(1, n + 1):
        out.append({"split": "train", "step": step, "loss": 4.0 / step, "lr": lr * step / n,
                    "tokens_per_s": 1000.0 + step, "mfu": 0.1})
        if step % 5 == 0:
            out.append({"split": "val", "step": step, "val_loss": 4.2 / step, "val_ppl": 2.0 + step})
    return out


def write_run(run: Path, model: TransformerConfig | None, metrics: list[dict], *, seed: int = 0,
              lr: float = 1e-3) -> Path:
    """A run directory: config.toml, metrics.jsonl and, with ``model``, a step-000010 checkpoint and best."""
    run.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer("char", [TEXT])
    cfg = RunConfig(model=model or TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2))
    cfg.train.lr = lr
    (run / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics), encoding="utf-8")
    if model is not None:
        save_checkpoint(run / "step-000010", build_model(cfg.model, seed=seed), tok, cfg)
        os.symlink("step-000010", run / "best")
    return run


def vocab() -> int:
    return train_tokenizer("char", [TEXT]).vocab_size


def make_runs(root: Path) -> Path:
    """``dec`` (a causal decoder, rope), ``s2s`` (an encoder-decoder), ``enc`` (an encoder),
    ``plain`` (metrics only), under ``root``."""
    v = vocab()
    write_run(root / "dec", TransformerConfig(arch="decoder", vocab_size=v, d_model=32, n_layers=2, n_heads=4,
                                              position="rope", max_seq_len=64), records(20))
    write_run(root / "s2s", TransformerConfig(arch="encoder-decoder", vocab_size=v, d_model=32, n_layers=1,
                                              n_heads=2, position="sinusoidal", max_seq_len=64), records(10, 3e-4),
              lr=3e-4)
    write_run(root / "enc", TransformerConfig(arch="encoder", vocab_size=v, d_model=16, n_layers=1, n_heads=2,
                                              max_seq_len=64), records(5))
    write_run(root / "plain", None, records(12))
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The runs folder of ``make_runs``, once per test module."""
    return make_runs(tmp_path_factory.mktemp("runs"))
