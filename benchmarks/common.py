"""What several benchmarks share: the GPT-2 shape on both sides, a timer, synthetic batches."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from blockformer import TransformerConfig, build_model
from blockformer.data.lm import LMDataset
from blockformer.train.objective import LanguageModelling
from blockformer.precision import resolve_precision


def cpu_kind() -> str:
    """The CPU kind a figure was measured on (AMX-BF16, AVX512-BF16, AVX512, AVX2), and the cap that
    ``ATEN_CPU_CAPABILITY`` set, if any."""
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split() if platform.system() == "Linux" else []
    kind = ("AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags
            else "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?")
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    return f"{kind}, capped to {cap} (ATEN_CPU_CAPABILITY)" if cap else kind


def add_shape_args(p) -> None:
    """``--layers --d-model --heads --vocab``, GPT-2 small's by default."""
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)


def gpt2_config(layers: int = 12, d_model: int = 768, heads: int = 12, vocab: int = 50257,
                max_len: int = 1024) -> TransformerConfig:
    """GPT-2's architecture: learned positions, GELU, pre-norm LayerNorm, biases, tied head."""
    return TransformerConfig(
        arch="decoder", vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=heads, max_seq_len=max_len,
        position="learned", ffn="gelu", norm="layer", norm_position="pre", tie_embeddings=True, bias=True,
        dropout=0.0,
    )


def blockformer_gpt2(cfg: TransformerConfig, device: torch.device, dtype: torch.dtype = torch.float32):
    return build_model(cfg, seed=0).to(device=device, dtype=dtype)


def hf_gpt2(cfg: TransformerConfig, device: torch.device, dtype: torch.dtype = torch.float32):
    """Hugging Face ``GPT2LMHeadModel`` of the same shape, with its SDPA attention, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1,
    )
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(hf_cfg).to(device=device, dtype=dtype)


def synthetic_lm(vocab: int, seq_len: int, batch: int, device: torch.device, n_tokens: int = 200_000):
    """A language-modelling objective over random tokens (speed does not depend on them)."""
    tokens = np.random.default_rng(0).integers(0, vocab, n_tokens).astype(np.int64)
    train = LMDataset(tokens, seq_len, "train", 0.1)
    val = LMDataset(tokens, seq_len, "val", 0.1)
    return LanguageModelling(train, val, batch, 0, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Best wall time of ``repeats`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def device_and_precision(args) -> tuple[torch.device, str]:
    """Threads, device and the resolved precision from a script's ``--threads/--device/--precision``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    return device, resolve_precision(args.precision, device)


def report(lines: list[str], out: str | Path | None) -> None:
    """Print a benchmark's markdown table (its lines), and write it to ``out`` where given."""
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
