"""What reading keys and values through block tables costs: one decode step's attention
(a query per row over its past) from the paged pool, two ways the serving engine can do it
- gathered (each row's blocks copied out with one ``index_select``, then SDPA with a mask
for the shorter rows; what prefill chunks do) and in place (the C kernel of
``serve/paged_attention.py``, what decoding rows do) - against SDPA on a contiguous cache
(``generate``'s ``KVCache``). Per layer, GPT-2-small's heads (12 x 64), fp32, blocks of 16
tokens scattered through the pool; the three outputs are checked equal. ``--pool-dtypes``
adds the in-place kernel over a narrower pool (``serve --kv-cache-dtype``): bf16, fp16, or int8
codes with a scale per slot and head, each checked against SDPA over what that pool holds.

    python benchmarks/bench_paged_attention.py --threads 1 --out benchmarks/results/paged-attention.md
    python benchmarks/bench_paged_attention.py --threads 2 --pool-dtypes bf16,int8
    python benchmarks/bench_paged_attention.py --threads 2 --one-row --pool-dtypes bf16,int8   # split-K

``--one-row``: one decoding row (a server with one request), its slots split between the threads and
the parts merged, against the same kernel on one thread, alternated, over 12 layers' pools.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from blockformer.nn.kv_cache import dequantize_rows, quantize_rows
from blockformer.serve.paged_attention import decode_attention, kernel
from blockformer.serve.runner import gather

from common import cpu_kind, report


def timed(fn, repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(5):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats


POOLS = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def narrow(pool: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``pool`` kept in ``dtype``: (what the pool holds, an int8 pool's scales or None, its values as fp32)."""
    if dtype == torch.int8:
        codes, scale = quantize_rows(pool)
        return codes, scale, dequantize_rows(codes, scale, torch.float32)
    held = pool.to(dtype)
    return held, None, held.float()


def case(B: int, S: int, H: int = 12, hd: int = 64, block: int = 16, repeats: int = 200,
         pools: tuple[str, ...] = ()) -> tuple[float, ...]:
    """(contiguous, gathered, in place, then in place over each of ``pools``) seconds for one
    layer's decode attention: B rows, pasts of S/2..S."""
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
    times = [timed(contiguous, repeats), timed(paged, repeats), timed(in_place, repeats)]
    for name in pools:
        (nk, k_scale, fk), (nv, v_scale, fv) = narrow(pool_k, POOLS[name]), narrow(pool_v, POOLS[name])
        scales = None if k_scale is None else (k_scale, v_scale)

        def narrow_in_place():
            return decode_attention(q_rows, nk, nv, read_rows, valid, hd**-0.5, out, scales)

        want = F.scaled_dot_product_attention(q, gather(fk, read, B, S, buf_k), gather(fv, read, B, S, buf_v),
                                              attn_mask=mask)[:, :, 0]
        torch.testing.assert_close(narrow_in_place(), want, atol=1e-5, rtol=1e-5)
        times.append(timed(narrow_in_place, repeats))
    return tuple(times)


def one_row(S: int, threads: int, pool: str = "fp32", H: int = 12, hd: int = 64, block: int = 16,
            layers: int = 12, rounds: int = 20) -> tuple[float, float]:
    """(one thread, ``threads`` threads) median seconds a layer for one row over S slots: the kernel on one
    thread against the same call with the row's slots split between the threads. ``layers`` layers' pools,
    so that each call reads its keys and values from memory, as in a step; the two take turns."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for _ in range(layers):
        n_blocks = S // block * 2
        pool_k, pool_v = torch.randn(n_blocks * block, H, hd, generator=g), torch.randn(n_blocks * block, H, hd, generator=g)
        k, k_scale, _ = narrow(pool_k, POOLS[pool]) if pool in POOLS else (pool_k, None, None)
        v, v_scale, _ = narrow(pool_v, POOLS[pool]) if pool in POOLS else (pool_v, None, None)
        table = torch.randperm(n_blocks, generator=g)[: S // block]
        read = (table[:, None] * block + torch.arange(block)).reshape(1, S)
        cases.append((torch.randn(1, H, hd, generator=g), k, v, read, None if k_scale is None else (k_scale, v_scale)))
    mask, out = torch.ones(1, S, dtype=torch.bool), torch.empty(1, H, hd)
    times: dict[int, list[float]] = {1: [], threads: []}
    with torch.inference_mode():
        for _ in range(rounds):
            for n in (1, threads):
                torch.set_num_threads(n)
                start = time.perf_counter()
                for q, k, v, read, scales in cases:
                    decode_attention(q, k, v, read, mask, hd**-0.5, out, scales)
                times[n].append((time.perf_counter() - start) / layers)
    torch.set_num_threads(threads)
    return statistics.median(times[1]), statistics.median(times[threads])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pool-dtypes", default="", help="also the kernel over these pools: bf16, fp16, int8")
    parser.add_argument("--one-row", action="store_true",
                        help="only one row's slots split between --threads threads against one thread")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    pools = tuple(n for n in args.pool_dtypes.split(",") if n)
    if any(n not in POOLS for n in pools):
        parser.error(f"--pool-dtypes: {args.pool_dtypes!r}; expected names among {', '.join(POOLS)}")
    torch.set_num_threads(args.threads)
    kind = cpu_kind()
    lines = [f"# Paged attention: one decode step's attention per layer ({kind} CPU, {args.threads} thread(s), "
             f"torch {torch.__version__})", "",
             "| rows | past tokens | contiguous cache (us) | gathered from blocks (us) | in place, C kernel (us) "
             "| gathered / contiguous | in place / contiguous |"
             + "".join(f" in place, {n} pool (us) | fp32 pool / {n} pool |" for n in pools),
             "|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(pools)]
    if kernel() is None or any(kernel(POOLS[n]) is None for n in pools):
        raise SystemExit("the paged attention kernel could not be built here (see the warning above)")
    if args.one_row:
        lines[0] = lines[0].replace("one decode step's attention per layer", "one row's slots split between threads")
        lines[2:] = ["| pool | past tokens | one thread (us a layer) | split (us a layer) | one / split |",
                     "|---|---:|---:|---:|---:|"]
        for pool in ("fp32", *pools):
            for S in (256, 1024, 2048, 4096):
                one, split = one_row(S, args.threads, pool)
                lines.append(f"| {pool} | {S} | {one * 1e6:.0f} | {split * 1e6:.0f} | {one / split:.2f}x |")
                print(lines[-1], flush=True)
        report(lines, args.out)
        return
    for B in (1, 16, 64):
        for S in (128, 512, 1024):
            c, p, k, *narrow_times = case(B, S, pools=pools)
            lines.append(f"| {B} | {S // 2}-{S} | {c * 1e6:.0f} | {p * 1e6:.0f} | {k * 1e6:.0f} | {p / c:.2f} | "
                         f"{k / c:.2f} |" + "".join(f" {t * 1e6:.0f} | {k / t:.2f} |" for t in narrow_times))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
