"""A KV cache kept in bf16, fp16 or int8 under an fp32 model (``generate(kv_cache_dtype=...)``,
``generate --kv-cache-dtype``): what it gains in decode speed at long contexts, and what it
costs in quality.

    python benchmarks/bench_kv_cache_dtype.py --threads 2                       # speed, GPT-2 small shape
    python benchmarks/bench_kv_cache_dtype.py --threads 2 --checkpoint runs/X/best  # and quality
    python benchmarks/bench_kv_cache_dtype.py --layers 2 --d-model 64 --heads 2 --vocab 300 --prompt 40 \\
        --tokens 8 --rounds 1                                                   # smoke

**Speed.** GPT-2 small's shape with random weights, batch 1, greedy: a prompt of ``--prompt``
tokens, then ``--tokens`` new ones, so the cache grows from ``--prompt`` slots. Each weight form
(``--weights``: fp32 streamed, as the CLI runs it where oneDNN packing is not picked, int8, int4)
decodes with each cache dtype in turn, ``--rounds`` times with the order rotated, in one process
(the host drifts between processes). The time is from the first new token to the last (the
prefill is the same work either way); the table says how many of the new tokens were the fp32
cache's (greedy on random weights: one flipped token changes those after it, not the work). The
ratio is fp32's median time over the dtype's.

**Quality** (``--checkpoint``, a byte- or token-level language model and its own validation
split, as ``blockformer eval`` reads it): ``--windows`` windows of the model's ``seq_len`` are
scored one token at a time through the cache, as decoding reads it, with each cache dtype:
the mean loss in nats per token, the largest difference of any logit from the fp32 cache's,
and how often the most likely next token is the fp32 cache's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from common import add_shape_args, cpu_kind, gpt2_config, report

from blockformer import build_model
from blockformer.generate import generate
from blockformer.generate.linears import load_operators_for, swap_linears
from blockformer.generate.packed import StreamedLinear
from blockformer.generate.quantize import quantize

CACHES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--prompt", type=int, default=768, help="prompt tokens (the cache starts this long)")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per generation")
    p.add_argument("--weights", nargs="+", default=["streamed", "int8", "int4"], choices=["streamed", "int8", "int4"])
    p.add_argument("--rounds", type=int, default=3, help="generations per weight form and cache dtype")
    p.add_argument("--checkpoint", default=None, help="also measure quality on this model's validation split")
    p.add_argument("--windows", type=int, default=32, help="validation windows scored per cache dtype")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the markdown tables here too")
    args = p.parse_args()
    if min(args.prompt, args.rounds, args.windows) < 1 or args.tokens < 2:
        p.error("--prompt, --rounds and --windows: expected at least 1; --tokens: at least 2")
    return args


def with_weights(model: torch.nn.Module, form: str) -> torch.nn.Module:
    model = copy.deepcopy(model)
    if form == "streamed":  # csrc/f32_matmul.c, what the CLI runs where it does not pack for oneDNN
        swap_linears(model, lambda m: StreamedLinear.of(m) if type(m) is torch.nn.Linear else None)
        load_operators_for(model, StreamedLinear)
        return model
    return quantize(model, form)


def decode_seconds(model, prompt: torch.Tensor, n: int, kv: str) -> tuple[float, list[int]]:
    """Seconds from the first new token to the last (n - 1 steps), and the tokens."""
    stamps: list[float] = []
    [ids] = generate(model, prompt, n, temperature=0, kv_cache_dtype=kv,
                     on_token=lambda row, tok: stamps.append(time.perf_counter()))
    return stamps[-1] - stamps[0], ids


def speed(args) -> list[str]:
    cfg = gpt2_config(args.layers, args.d_model, args.heads, args.vocab, max(1024, args.prompt + args.tokens))
    float_model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    slot_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # keys and values, per slot, per byte of dtype
    lines = [f"Decode with the KV cache in each dtype: {cpu_kind()}, {torch.get_num_threads()} threads, "
             f"d_model {cfg.d_model}, {cfg.n_layers} layers, prompt {args.prompt}, {args.tokens} new tokens "
             f"(the cache from {args.prompt} to {args.prompt + args.tokens} slots, "
             f"{slot_bytes * 4 * (args.prompt + args.tokens) / 2**20:.0f} MiB at the end in fp32), "
             f"{args.rounds} rounds, order rotated", "",
             "| weights | cache | tokens/s (median) | vs fp32 cache | faster in rounds | tokens as fp32's |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for form in args.weights:
        model = with_weights(float_model, form)
        decode_seconds(model, prompt[:, :16], 4, "fp32")  # warm-up: kernels built, threads awake
        times: dict[str, list[float]] = {kv: [] for kv in CACHES}
        tokens: dict[str, list[int]] = {}
        order = list(CACHES)
        for r in range(args.rounds):
            for kv in order[r % len(order):] + order[: r % len(order)]:
                seconds, tokens[kv] = decode_seconds(model, prompt, args.tokens, kv)
                times[kv].append(seconds)
        base = statistics.median(times["fp32"])
        for kv in CACHES:
            median = statistics.median(times[kv])
            wins = sum(t < f for t, f in zip(times[kv], times["fp32"]))
            same = next((i for i, (a, b) in enumerate(zip(tokens[kv], tokens["fp32"])) if a != b), args.tokens)
            lines.append(f"| {form} | {kv} | {(args.tokens - 1) / median:.1f} | {base / median:.3f}x | "
                         f"{'-' if kv == 'fp32' else f'{wins} of {args.rounds}'} | first {same} |")
    return lines


def quality(args) -> list[str]:
    from blockformer.data.lm import LMDataset  # noqa: PLC0415
    from blockformer.data.token_file import TokenFile, build_token_file  # noqa: PLC0415
    from blockformer.train.load import load_checkpoint  # noqa: PLC0415
    from blockformer.train.setup import default_cache_dir, text_spec  # noqa: PLC0415

    ckpt = load_checkpoint(args.checkpoint)
    model, data = ckpt.model.eval(), ckpt.config.data
    tokens = TokenFile(build_token_file(text_spec(data), ckpt.tokenizer, default_cache_dir(), max_bytes=data.max_bytes))
    val = LMDataset(tokens, data.seq_len, "val", data.val_fraction)
    T = data.seq_len
    starts = torch.linspace(0, len(val) - T - 1, args.windows).long()
    windows = torch.stack([torch.from_numpy(val.tokens[s:s + T + 1].astype("int64")) for s in starts.tolist()])
    x, y = windows[:, :-1], windows[:, 1:]
    logits: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for kv, dtype in CACHES.items():
            rows = []
            for batch in x.split(8):
                cache = model.new_cache(batch.shape[0], T, dtype=dtype)
                rows.append(torch.cat([model(batch[:, t:t + 1], cache=cache, cache_pos=torch.tensor([t]))
                                       for t in range(T)], dim=1))
            logits[kv] = torch.cat(rows)  # (windows, T, V): each position through the cache, one at a time
        whole = torch.cat([model(batch) for batch in x.split(8)])  # no cache: each window in one call
    loss = {kv: torch.nn.functional.cross_entropy(l.flatten(0, 1).float(), y.flatten()).item() for kv, l in logits.items()}
    whole_loss = torch.nn.functional.cross_entropy(whole.flatten(0, 1), y.flatten()).item()
    assert abs(whole_loss - loss["fp32"]) < 1e-4, "the fp32 cache must score as the whole window in one call does"
    lines = [f"Quality through the cache: {args.checkpoint}, {args.windows} validation windows of {T} tokens "
             f"({args.windows * T:,} predictions), each token through the cache one at a time", "",
             "| cache | loss (nats/token) | vs fp32 cache | largest logit difference | top-1 as fp32's |",
             "| --- | ---: | ---: | ---: | ---: |",
             f"| none: each window in one call | {whole_loss:.5f} | {whole_loss - loss['fp32']:+.5f} | - | - |"]
    top = logits["fp32"].argmax(-1)
    for kv in CACHES:
        gap = (logits[kv] - logits["fp32"]).abs().max().item()
        same = (logits[kv].argmax(-1) == top).float().mean().item()
        lines.append(f"| {kv} | {loss[kv]:.5f} | {loss[kv] - loss['fp32']:+.5f} | {gap:.2e} | {same:.2%} |")
    return lines


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = speed(args)
    if args.checkpoint:
        lines += ["", *quality(args)]
    report(lines, args.out)


if __name__ == "__main__":
    main()
