"""Decode attention from a cache that is not in the caches: ``csrc/decode_attention.c`` against
torch's SDPA, one query token per row over every slot.

1. The attention alone, GPT-2 small's heads (12 of 64), 12 layers' keys and values, a 64 MB
   buffer written between rounds so that they come from memory, as in a decode step, where
   the weights streamed since a layer last ran have pushed its cache out; and the kernel over
   the same caches kept in bf16, fp16 and int8 (``generate --kv-cache-dtype``).
2. The eager decode step (GPT-2 small, random weights, batch 1, greedy, fp32 activations, as
   the CLI prepares it), with ``kernels.DECODE_ATTENTION_KERNEL`` on and off in alternate
   rounds of one process, so that a shared machine's drift falls on both alike.

    OMP_NUM_THREADS=2 python benchmarks/bench_decode_attention.py --threads 2 --slots 80 272 1024 \\
        --schemes fp32 int8 int4 --prompt 16 512
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import add_shape_args, cpu_kind, gpt2_config, report

from blockformer import build_model, kernels
from blockformer.generate import generate
from blockformer.generate.packed import pack_linears
from blockformer.generate.quantize import SCHEMES, quantize
from blockformer.nn.decode_attention import decode_attention, kernel


def attention_alone(slots: list[int], rounds: int, heads: int, head_dim: int, layers: int) -> list[str]:
    """SDPA and the kernel over fp32 caches, and the kernel over the same caches kept in bf16, fp16 and
    int8 (``kv_cache_dtype``: half or a quarter of the bytes, widened as they are read)."""
    from blockformer.nn.kv_cache import quantize_rows  # noqa: PLC0415

    lines = ["| slots | SDPA, us a layer | kernel, us a layer | speedup | SDPA, GB/s | kernel, GB/s "
             "| bf16 cache, us | fp16 cache, us | int8 cache, us | bf16, fp16, int8 over fp32 kernel |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    flush = torch.zeros(16 * 1024 * 1024)  # 64 MB, above the last-level cache
    for S in slots:
        ks = [torch.randn(1, heads, S, head_dim) for _ in range(layers)]
        vs = [torch.randn(1, heads, S, head_dim) for _ in range(layers)]
        narrow = {dtype: ([k.to(dtype) for k in ks], [v.to(dtype) for v in vs]) for dtype in (torch.bfloat16, torch.float16)}
        q = torch.randn(1, heads, 1, head_dim)
        torch.testing.assert_close(decode_attention(q, ks[0], vs[0], None, head_dim ** -0.5),
                                   F.scaled_dot_product_attention(q, ks[0], vs[0]), rtol=1e-5, atol=1e-5)
        int8 = [quantize_rows(k) for k in ks], [quantize_rows(v) for v in vs]  # (codes, scales) each
        caches = {"sdpa": (ks, vs), "kernel": (ks, vs), "bf16": narrow[torch.bfloat16], "fp16": narrow[torch.float16],
                  "int8": int8}
        best = dict.fromkeys(caches, float("inf"))
        with torch.inference_mode():
            for _ in range(rounds):
                for name, (kk, vv) in caches.items():
                    flush.add_(1.0)
                    t = time.perf_counter()
                    for k, v in zip(kk, vv):
                        if name == "sdpa":
                            F.scaled_dot_product_attention(q, k, v)
                        elif name == "int8":
                            torch.ops.blockformer_c.decode_attention(q, k[0], v[0], None, head_dim ** -0.5, k[1], v[1])
                        else:
                            torch.ops.blockformer_c.decode_attention(q, k, v, None, head_dim ** -0.5, None, None)
                    best[name] = min(best[name], (time.perf_counter() - t) / layers)
        nbytes = 2 * heads * S * head_dim * 4
        a, b = best["sdpa"], best["kernel"]
        lines.append(f"| {S} | {a * 1e6:.1f} | {b * 1e6:.1f} | {a / b:.2f}x | {nbytes / a / 1e9:.1f} | "
                     f"{nbytes / b / 1e9:.1f} | {best['bf16'] * 1e6:.1f} | {best['fp16'] * 1e6:.1f} | "
                     f"{best['int8'] * 1e6:.1f} | {b / best['bf16']:.2f}x, {b / best['fp16']:.2f}x, "
                     f"{b / best['int8']:.2f}x |")
    return lines


def decode_step(args, float_model, cfg) -> list[str]:
    lines = ["| scheme | prompt | SDPA, ms/token | kernel, ms/token | speedup (medians) | kernel faster in |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for scheme in args.schemes:
        model = copy.deepcopy(float_model)
        model = pack_linears(model) if scheme == "fp32" else quantize(model, scheme)
        for T in args.prompt:
            prompt = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
            runs = {True: [], False: []}
            outs = {}
            for r in range(args.rounds + 1):  # round 0 warms up each way
                for on in (True, False) if r % 2 else (False, True):
                    kernels.DECODE_ATTENTION_KERNEL = on
                    t = time.perf_counter()
                    outs[on] = generate(model, prompt, args.tokens, temperature=0)
                    if r:
                        runs[on].append((time.perf_counter() - t) / args.tokens * 1e3)
            kernels.DECODE_ATTENTION_KERNEL = True
            assert outs[True] == outs[False], "the kernel must give SDPA's greedy tokens"
            a, b = statistics.median(runs[False]), statistics.median(runs[True])
            wins = sum(x > y for x, y in zip(runs[False], runs[True]))
            lines.append(f"| {scheme} | {T} | {a:.2f} | {b:.2f} | {a / b:.3f}x | {wins} of {args.rounds} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--slots", type=int, nargs="+", default=[80, 272, 1024], help="cache slots, attention alone")
    p.add_argument("--schemes", nargs="*", choices=["fp32", *SCHEMES], default=["fp32", "int8", "int4"])
    p.add_argument("--prompt", type=int, nargs="+", default=[16, 512], help="prompt lengths, decode step")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.tokens < 1 or args.rounds < 1 or min(args.slots) < 1 or min(args.prompt) < 1:
        p.error("--tokens, --rounds, --slots and --prompt: expected at least 1")
    torch.set_num_threads(args.threads)
    if kernel() is None:
        p.error("csrc/decode_attention.c could not be built on this machine")
    cfg = gpt2_config(args.layers, args.d_model, args.heads, args.vocab, max_len=max(1024, max(args.prompt) + args.tokens))
    lines = [f"decode attention, {args.heads} heads of {args.d_model // args.heads}, threads {torch.get_num_threads()}, "
             f"torch {torch.__version__}, CPU {cpu_kind()}", "",
             f"attention alone, {args.layers} layers' caches from memory, best of {args.rounds} rounds:", "",
             *attention_alone(args.slots, args.rounds, args.heads, args.d_model // args.heads, args.layers)]
    if args.schemes:
        float_model = build_model(cfg, seed=0).eval()
        lines += ["", f"eager decode step, {args.layers} layers, batch 1, {args.tokens} new tokens, median of "
                  f"{args.rounds} alternated rounds:", "", *decode_step(args, float_model, cfg)]
    report(lines, args.out)


if __name__ == "__main__":
    main()
