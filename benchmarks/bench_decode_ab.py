"""Two quantization schemes' decode steps in one process, their runs alternated (A, B, B, A,
...), so that a shared machine's drift falls on both alike: where ``bench_decode.py`` times its
variants one after another, minutes apart, and this host's speed moves by a third between
them. GPT-2 small by default, random weights, batch 1, fp32 activations, greedy; each round
decodes ``--tokens`` new tokens per scheme, and the table gives each scheme's median and best
round in tokens/s and the ratio of the medians.

    OMP_NUM_THREADS=2 python benchmarks/bench_decode_ab.py --a int8 --b int8-a8 --threads 2 --compile
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from common import add_shape_args, cpu_kind, gpt2_config

from blockformer import build_model
from blockformer.generate import generate
from blockformer.generate.quantize import SCHEMES, quantize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--a", choices=SCHEMES, default="int8")
    p.add_argument("--b", choices=SCHEMES, default="int8-a8")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per round and scheme")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="compiled decode steps (generate(compile=True))")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = gpt2_config(args.layers, args.d_model, args.heads, args.vocab)
    float_model = build_model(cfg, seed=0).eval()
    models = {s: quantize(copy.deepcopy(float_model), s) for s in (args.a, args.b)}
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).tolist()

    def run(scheme: str) -> float:
        start = time.perf_counter()
        out = generate(models[scheme], prompt, args.tokens, temperature=0, compile=args.compile)
        assert len(out[0]) == args.tokens
        return args.tokens / (time.perf_counter() - start)

    for scheme in models:  # warm-up (and compile)
        run(scheme)
    speeds: dict[str, list[float]] = {s: [] for s in models}
    for r in range(args.rounds):
        for scheme in (models if r % 2 == 0 else reversed(list(models))):
            speeds[scheme].append(run(scheme))
    median = {s: statistics.median(v) for s, v in speeds.items()}
    mode = "compiled" if args.compile else "eager"
    lines = [f"# Decode, {args.a} against {args.b}, {mode}, alternated ({cpu_kind()} CPU, {args.threads} thread(s), "
             f"torch {torch.__version__})", "",
             f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab}; batch 1, prompt 16, "
             f"{args.tokens} new tokens a round, {args.rounds} rounds each", "",
             "| scheme | median tokens/s | best tokens/s | every round |", "| --- | ---: | ---: | --- |"]
    for s, v in speeds.items():
        lines.append(f"| {s} | {median[s]:.1f} | {max(v):.1f} | {', '.join(f'{x:.0f}' for x in v)} |")
    lines += ["", f"{args.b} / {args.a}, medians: **{median[args.b] / median[args.a]:.2f}x**"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
