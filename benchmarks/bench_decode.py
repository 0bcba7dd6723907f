"""Greedy decode speed at batch 1: blockformer (no cache / cache / compiled step) against
Hugging Face ``GPT2LMHeadModel.generate`` on the same shape, in the same run.

    python benchmarks/bench_decode.py                      # GPT-2 small shape, 256 new tokens
    python benchmarks/bench_decode.py --dtype bf16 --threads 2
    python benchmarks/bench_decode.py --layers 2 --d-model 128 --heads 4 --vocab 1000 --tokens 16  # smoke

Both models have random weights (speed does not depend on them) and the GPT-2 shape:
learned positions, GELU, LayerNorm, pre-norm, tied embeddings. Neither stops early:
blockformer has no EOS, Hugging Face gets ``min_new_tokens = max_new_tokens``.

What makes blockformer's per-token cost small: the KV cache is allocated once (Hugging
Face's grows by concatenation); the decode step has fixed shapes, so ``torch.compile``
captures it once (and on CUDA replays it as a CUDA graph, removing per-kernel launch
overhead, which dominates at batch 1); tokens stay on the device, with no host sync per
token. What to expect: on a CPU at batch 1 both libraries are bound by reading every
weight from memory once per token (about 0.5 GB in fp32 for GPT-2 small, 25-45 ms per
token on one core), so only framework overhead separates them: expect roughly parity in
fp32 and a modest lead in bf16 (a 4-layer check on a 2-core EPYC gave about 1.0x fp32,
1.25x bf16), not 2x. Reading fewer bytes per token is what helps on a CPU: the ``int8-*``
variants store the matmul weights as int8 with per-channel scales (weight-only
quantization, as gpt-fast does), so the step reads 4x fewer weight bytes than fp32; the
``int4-*`` variants (groups of 128 weights sharing a scale and offset) 8x fewer. On a GPU, where per-kernel launch overhead dominates at batch 1,
the compiled step replayed as a CUDA graph is expected to be several times faster.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from blockformer import TransformerConfig, build_model
from blockformer.generate import generate
from blockformer.generate.quantize import Int4Linear, Int8Linear, quantize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per run")
    p.add_argument("--prompt", type=int, default=16, help="prompt length")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per variant (the best is kept)")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["nocache", "cache", "compiled", "int8-cache", "int8-compiled", "int4-cache",
                            "int4-compiled", "hf"],
                   help="variants to leave out (nocache is slow: it recomputes the whole sequence)")
    return p.parse_args()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Best wall time of ``repeats`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype, n = torch.device(args.device), DTYPES[args.dtype], args.tokens
    max_len = args.prompt + n
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    results: dict[str, float] = {}

    cfg = TransformerConfig(
        arch="decoder", vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
        n_heads=args.heads, max_seq_len=max(1024, max_len), position="learned", ffn="gelu",
        norm="layer", norm_position="pre", tie_embeddings=True, bias=True,
    )
    ours = build_model(cfg, seed=0).to(device=device, dtype=dtype).eval()
    variants = {
        "nocache": dict(use_cache=False),
        "cache": dict(use_cache=True),
        "compiled": dict(use_cache=True, compile=True),
        "int8-cache": dict(use_cache=True),
        "int8-compiled": dict(use_cache=True, compile=True),
        "int4-cache": dict(use_cache=True),
        "int4-compiled": dict(use_cache=True, compile=True),
    }
    float_model = ours
    for name, kw in variants.items():
        if name in args.skip:
            continue
        scheme = name.split("-")[0] if name.startswith("int") else None
        if scheme is not None and not any(isinstance(m, QUANTIZED[scheme]) for m in ours.modules()):
            ours = quantize(copy.deepcopy(float_model), scheme)  # int8 / int4 weights, activations in --dtype
            torch._dynamo.reset()

        def run(tokens: int = n, kw=kw) -> None:
            out = generate(ours, prompt, tokens, temperature=0, **kw)
            assert len(out[0]) == tokens

        run(n if "compiled" in name else min(n, 8))  # warm-up (the compiled step's shapes depend on n)
        results[f"blockformer {name}"] = n / timed(run, device, args.repeats)
    del ours, float_model

    if "hf" not in args.skip:
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_cfg = GPT2Config(
            vocab_size=args.vocab, n_positions=max(1024, max_len), n_embd=args.d_model,
            n_layer=args.layers, n_head=args.heads, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1,
        )
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(hf_cfg).to(device=device, dtype=dtype).eval()
        ids = prompt.to(device)
        mask = torch.ones_like(ids)

        def run_hf(tokens: int = n) -> None:
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
                                  min_new_tokens=tokens, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + tokens

        run_hf(min(n, 8))
        results["hf GPT2LMHeadModel.generate"] = n / timed(run_hf, device, args.repeats)

    hf_rate = results.get("hf GPT2LMHeadModel.generate")
    lines = [f"greedy decode, batch 1, prompt {args.prompt}, {n} new tokens, {args.layers} layers, "
             f"d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, {args.dtype}, {device}, "
             f"threads {torch.get_num_threads()}, best of {args.repeats}, torch {torch.__version__}",
             "", "| variant | tokens/s | vs HF |", "| --- | ---: | ---: |"]
    for name, rate in results.items():
        ratio = f"{rate / hf_rate:.2f}x" if hf_rate else "-"
        lines.append(f"| {name} | {rate:.1f} | {ratio} |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
