"""What reading keys and values through block tables costs: one decode step's attention
(a query per row over its past) from the paged pool, two ways the serving engine can do it
- gathered (each row's blocks copied out with one ``index_select``, then SDPA with a mask
for the shorter rows; what prefill chunks do) and in place (the C kernel of
``serve/paged_attention.py``, what decoding rows do) - against SDPA on a contiguous cache
(``generate``'s ``KVCache``). Per layer, GPT-2-small's heads (12 x 64), fp32, blocks of 16
tokens scattered through the pool; the three outputs are checked equal.

    python benchmarks/bench_paged_attention.py --threads 1 --out benchmarks/results/paged-attention.md
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from blockformer.serve.paged_attention import decode_attention, kernel
from blockformer.serve.runner import gather

from common import cpu_kind


def timed(fn, repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(5):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats


def case(B: int, S: int, H: int = 12, hd: int = 64, block: int = 16, repeats: int = 200) -> tuple[float, ...]:
    """(contiguous, gathered, in place) seconds for one layer's decode attention: B rows,
    pasts of S/2..S."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
    q = torch.randn(B, H, 1, hd, generator=g)
    cache_k, cache_v = torch.randn(B, H, S, hd, generator=g), torch.randn(B, H, S, hd, generator=g)
    mask = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    n_blocks = B * (S // block) * 2
    pool_k, pool_v = torch.randn(n_blocks * block, H, hd, generator=g), torch.randn(n_blocks * block, H, hd, generator=g)
    tables = torch.randperm(n_blocks, generator=g)[: B * (S // block)].view(B, S // block)  # scattered blocks
    read = (tables[:, :, None] * block + torch.arange(block)).reshape(-1)  # (B * S,) pool slots
    buf_k, buf_v = pool_k.new_empty(B * S, H, hd), pool_v.new_empty(B * S, H, hd)  # the engine keeps its buffers

    def contiguous():
        return F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)

    def paged():
        k, v = gather(pool_k, read, B, S, buf_k), gather(pool_v, read, B, S, buf_v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q_rows, out, valid, read_rows = q[:, :, 0].contiguous(), q.new_empty(B, H, hd), mask[:, 0, 0].contiguous(), read.view(B, S)

    def in_place():
        return decode_attention(q_rows, pool_k, pool_v, read_rows, valid, hd**-0.5, out)

    torch.testing.assert_close(in_place(), paged()[:, :, 0], atol=1e-5, rtol=1e-5)
    return timed(contiguous, repeats), timed(paged, repeats), timed(in_place, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kind = cpu_kind()
    lines = [f"# Paged attention: one decode step's attention per layer ({kind} CPU, {args.threads} thread(s), "
             f"torch {torch.__version__})", "",
             "| rows | past tokens | contiguous cache (us) | gathered from blocks (us) | in place, C kernel (us) "
             "| gathered / contiguous | in place / contiguous |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    if kernel() is None:
        raise SystemExit("the paged attention kernel could not be built here (see the warning above)")
    for B in (1, 16, 64):
        for S in (128, 512, 1024):
            c, p, k = case(B, S)
            lines.append(f"| {B} | {S // 2}-{S} | {c * 1e6:.0f} | {p * 1e6:.0f} | {k * 1e6:.0f} | {p / c:.2f} | "
                         f"{k / c:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
