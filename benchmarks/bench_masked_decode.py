"""Decode attention with a key mask: what taking ``csrc/decode_attention.c`` at the steps that
have a mask gains over SDPA, which every such step ran before.

    python benchmarks/bench_masked_decode.py --threads 2
    python benchmarks/bench_masked_decode.py --layers 2 --d-model 64 --heads 2 --vocab 300 --prompt 40 \\
        --tokens 8 --rounds 1 --cases padded seq2seq                        # smoke

Three kinds of step carry a mask over the keys:

- **padded**: ``generate`` over prompts of different lengths, left-padded into one batch (four
  prompts of ``--prompt``, 3/4, 1/2 and 1/4 of it), eager, weights streamed as the CLI runs them;
- **compiled**: ``generate(compile=True)``, batch 1, a prompt of ``--prompt``: the compiled step
  attends over every slot of its cache, the unwritten ones masked;
- **seq2seq**: greedy and beam-4 decoding of ``translate-small``'s shape (3+3 layers, d_model 256)
  with random weights over 16 sources of 8 to 40 tokens: cross-attention carries the sources'
  padding, self-attention none (it takes the kernel either way).

Each runs with the KV cache in fp32 and in bf16 (``kv_cache_dtype``; the seq2seq cache is the
model's), the kernel on and off (``kernels.DECODE_ATTENTION_KERNEL``; off is the SDPA path each of
these steps took before), ``--rounds`` times, alternated, in one process. GPT-2 small's shape,
random weights, greedy. Time: from the first new token to the last (seq2seq: the whole decode).
The ratio is the median time with the kernel off over on; the last column says whether both
gave the same tokens (greedy on random weights: rounding may flip a near tie).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from common import add_shape_args, cpu_kind, gpt2_config, report

from blockformer import TransformerConfig, build_model, kernels
from blockformer.generate import beam_search, generate, greedy_decode
from blockformer.generate.linears import load_operators_for, swap_linears
from blockformer.generate.packed import StreamedLinear

CASES = ("padded", "compiled", "seq2seq")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--prompt", type=int, default=768, help="the longest prompt's tokens")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    p.add_argument("--rounds", type=int, default=3, help="runs per case, cache dtype and kernel choice")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the markdown table here too")
    args = p.parse_args()
    if args.prompt < 4 or args.rounds < 1 or args.tokens < 2:
        p.error("--prompt: expected at least 4; --rounds: at least 1; --tokens: at least 2")
    return args


def streamed(model: torch.nn.Module) -> torch.nn.Module:
    """The model as the CLI decodes fp32 where it does not pack for oneDNN: csrc/f32_matmul.c."""
    model = copy.deepcopy(model)
    swap_linears(model, lambda m: StreamedLinear.of(m) if type(m) is torch.nn.Linear else None)
    load_operators_for(model, StreamedLinear)
    return model


def decoder_run(model, prompts: list[list[int]], n: int, kv: str, compile: bool):
    def run():
        stamps: list[float] = []
        out = generate(model, prompts, n, temperature=0, kv_cache_dtype=kv, compile=compile,
                       on_token=lambda row, tok: row == 0 and stamps.append(time.perf_counter()))
        return stamps[-1] - stamps[0], out
    return run


def seq2seq_runs(args) -> dict[str, callable]:
    cfg = TransformerConfig(arch="encoder-decoder", vocab_size=6000, d_model=256, n_layers=3, n_heads=4, d_ff=1024,
                            max_seq_len=256, norm_position="pre", ffn="relu", position="sinusoidal",
                            scale_embeddings=True, tie_embeddings=True, dropout=0.0)
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    sources = [torch.randint(4, 6000, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 41, (16,), generator=g)]

    def timed(fn):
        def run():
            start = time.perf_counter()
            out = fn()
            return time.perf_counter() - start, out
        return run

    return {"greedy": timed(lambda: greedy_decode(model, sources, max_len=args.tokens)),
            "beam 4": timed(lambda: [[h.tokens for h in b] for b in beam_search(model, sources, beam_size=4,
                                                                                 max_len=args.tokens)])}


def runs(args) -> list[tuple[str, str, callable]]:
    """(case, cache, a run returning (seconds, tokens)) for every case asked for."""
    out = []
    need = {"padded", "compiled"} & set(args.cases)
    if need:
        P = args.prompt
        cfg = gpt2_config(args.layers, args.d_model, args.heads, args.vocab, max(1024, P + args.tokens))
        model = build_model(cfg, seed=0).eval()
        ids = torch.randint(0, cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(0)).tolist()
        if "padded" in need:
            prompts, fast = [ids[: P * k // 4] for k in (4, 3, 2, 1)], streamed(model)
            out += [("padded, batch 4", kv, decoder_run(fast, prompts, args.tokens, kv, False)) for kv in ("fp32", "bf16")]
        if "compiled" in need:
            out += [("compiled, batch 1", kv, decoder_run(model, [ids], args.tokens, kv, True)) for kv in ("fp32", "bf16")]
    if "seq2seq" in args.cases:
        out += [(f"seq2seq {name}, 16 sources", "fp32", run) for name, run in seq2seq_runs(args).items()]
    return out


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = [f"Decode attention with a key mask: {cpu_kind()}, {torch.get_num_threads()} threads, GPT-2 shape "
             f"d_model {args.d_model}, {args.layers} layers, longest prompt {args.prompt}, {args.tokens} new tokens, "
             f"{args.rounds} rounds alternated", "",
             "| case | KV cache | SDPA (kernel off), s | kernel, s | off / on | faster in rounds | same tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for case, kv, run in runs(args):
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens = {}
        for on in (True, False):  # warm-up: kernels built, graphs compiled, threads awake
            kernels.DECODE_ATTENTION_KERNEL = on
            run()
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                kernels.DECODE_ATTENTION_KERNEL = on
                seconds, tokens[on] = run()
                times[on].append(seconds)
        kernels.DECODE_ATTENTION_KERNEL = True
        on, off = statistics.median(times[True]), statistics.median(times[False])
        wins = sum(a < b for a, b in zip(times[True], times[False]))
        lines.append(f"| {case} | {kv} | {off:.3f} | {on:.3f} | {off / on:.3f}x | {wins} of {args.rounds} | {'yes' if tokens[True] == tokens[False] else 'no'} |")
        print(lines[-1], flush=True)
    report(lines, args.out)


if __name__ == "__main__":
    main()
