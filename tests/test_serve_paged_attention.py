"""The decode-attention kernel that reads the paged pool in place: it gives what a gathered
copy and SDPA give, on every thread count and head grouping; where it cannot be built the
engine says so and falls back, with the same tokens."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from blockformer import native
from blockformer.generate import generate, greedy_decode
from blockformer.nn.kv_cache import dequantize_rows, quantize_rows
from blockformer.serve import Engine, SamplingParams, paged_attention
from blockformer.serve.runner import PagedPool, gather
from blockformer.tokenizers import EOS_ID

from test_serve_engine import GREEDY, TOK, alone, make, prompts, staggered


def scattered(rows, S, H, Hkv, D, block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = rows * (S // block) * 3
    pool_k, pool_v = (torch.randn(n_blocks * block, Hkv, D, generator=g) for _ in range(2))
    tables = torch.randperm(n_blocks, generator=g)[: rows * (S // block)].view(rows, -1)
    read = (tables[:, :, None] * block + torch.arange(block)).reshape(rows, S)
    lengths = torch.randint(1, S + 1, (rows,), generator=g)
    mask = torch.arange(S)[None, :] >= S - lengths[:, None]  # right-aligned pasts, as the runner lays them out
    mask[0, S - 2] = False  # and a hole: the kernel follows the mask, not a length
    return torch.randn(rows, H, D, generator=g), pool_k, pool_v, read, mask


def gathered(q, pool_k, pool_v, read, mask, scale):
    rows, S = read.shape
    k = gather(pool_k, read.reshape(-1), rows, S, pool_k.new_empty(rows * S, *pool_k.shape[1:]))
    v = gather(pool_v, read.reshape(-1), rows, S, pool_v.new_empty(rows * S, *pool_v.shape[1:]))
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None], scale=scale,
                                          enable_gqa=True)[:, :, 0]


@pytest.mark.parametrize("rows,heads,kv_heads,threads", [
    (7, 4, 4, 1), (7, 8, 2, 1), (7, 6, 1, 2), (7, 8, 2, 3),
    (1, 6, 3, 2), (1, 8, 2, 3), (2, 12, 3, 3), (3, 4, 4, 2),  # fewer rows than threads, or a row cut between them
])
def test_the_kernel_equals_a_gathered_copy_through_sdpa(rows, heads, kv_heads, threads, monkeypatch):
    """With fewer rows than threads each row's slots are split between them and the parts merged
    (parts of 4 slots at least here, so that 24 slots split)."""
    assert paged_attention.kernel() is not None  # a C compiler is part of the set-up (README)
    monkeypatch.setattr(paged_attention, "PART_SLOTS", 4)
    q, pool_k, pool_v, read, mask = scattered(rows, 24, heads, kv_heads, 16, seed=heads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention.decode_attention(q, pool_k, pool_v, read, mask, 0.3, torch.full_like(q, float("nan")))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, gathered(q, pool_k, pool_v, read, mask, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_rows_slots_split_between_threads_give_its_attention_with_parts_masked_whole(threads, monkeypatch):
    """A row whose past covers only the last part, a part with one slot, and a row with no slot at all (zeros)."""
    monkeypatch.setattr(paged_attention, "PART_SLOTS", 4)
    q, pool_k, pool_v, read, _ = scattered(3, 24, 8, 2, 16, seed=5)
    mask = torch.zeros(3, 24, dtype=torch.bool)
    mask[0, 20:] = True  # the last part only
    mask[1, 3] = mask[1, 23] = True  # one slot in the first part and one in the last
    want = gathered(q[:2], pool_k, pool_v, read[:2], mask[:2], 0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = [paged_attention.decode_attention(q[i:i + 1], pool_k, pool_v, read[i:i + 1], mask[i:i + 1], 0.3,
                                                 torch.full_like(q[:1], float("nan"))) for i in range(3)]
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(torch.cat(rows[:2]), want, atol=1e-5, rtol=1e-5)
    assert rows[2].eq(0).all()


def test_one_row_over_many_slots_is_split_between_the_threads(monkeypatch):
    """At the real part size (64 slots), one row over 256 slots on two threads takes two parts, and gives what
    one thread gives."""
    q, pool_k, pool_v, read, mask = scattered(1, 256, 12, 12, 64, block=16, seed=1)
    calls = []
    real = paged_attention.kernel()
    monkeypatch.setattr(paged_attention, "kernel", lambda dtype=torch.float32: lambda *a: calls.append(a) or real(*a))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(paged_attention.decode_attention(q, pool_k, pool_v, read, mask, 0.125, torch.empty_like(q)))
    finally:
        torch.set_num_threads(before)
    assert [(c[15], c[-1]) for c in calls] == [(1, 1), (2, 2)]  # (parts, threads)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0], gathered(q, pool_k, pool_v, read, mask, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,threads", [(4, 4, 1), (8, 2, 2)])
def test_the_kernel_reads_a_bf16_pool_as_the_floats_it_holds(heads, kv_heads, threads):
    """A bf16 pool is read as it is (each value widened to fp32) and attended in fp32: the output
    is the fp32 attention over the same bf16 values, to fp32 rounding, in a bf16 or fp32 output."""
    assert paged_attention.kernel(torch.bfloat16) is not None
    q, pool_k, pool_v, read, mask = scattered(7, 24, heads, kv_heads, 16, seed=heads)
    q, pool_k, pool_v = q.bfloat16(), pool_k.bfloat16(), pool_v.bfloat16()
    want = gathered(q.float(), pool_k.float(), pool_v.float(), read, mask, 0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out32 = paged_attention.decode_attention(q, pool_k, pool_v, read, mask, 0.3, torch.full_like(want, float("nan")))
        out16 = paged_attention.decode_attention(q, pool_k, pool_v, read, mask, 0.3, torch.full_like(q, float("nan")))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out32, want, atol=1e-5, rtol=1e-5)
    assert out16.dtype == torch.bfloat16  # and the same values, rounded once (2**-8: half a bf16 step, relative)
    torch.testing.assert_close(out16.float(), want, atol=1e-5, rtol=2**-8)


def test_the_kernel_reads_an_fp16_pool_under_fp32_queries():
    """An fp32 model's pool kept in fp16 (``kv_cache_dtype="fp16"``): widened exactly as it is read."""
    assert paged_attention.kernel(torch.float16) is not None
    q, pool_k, pool_v, read, mask = scattered(7, 24, 8, 2, 16, seed=3)
    pool_k, pool_v = pool_k.half(), pool_v.half()
    pool_v[::3] = 3e-5  # subnormal in fp16
    out = paged_attention.decode_attention(q, pool_k, pool_v, read, mask, 0.3, torch.full_like(q, float("nan")))
    torch.testing.assert_close(out, gathered(q, pool_k.float(), pool_v.float(), read, mask, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,kv_heads,threads", [(7, 4, 1), (7, 2, 2), (7, 1, 3), (1, 4, 2), (2, 2, 3)])
def test_the_kernel_reads_an_int8_pool_as_its_codes_times_their_scales(rows, kv_heads, threads, monkeypatch):
    """An int8 pool (``quantize_rows``: codes and one scale per slot and head) attended in place
    gives the fp32 attention over the dequantized pool, on every thread count and grouping; the
    scales are read per slot and head (a pool whose scales are all alike would not show it)."""
    assert paged_attention.kernel(torch.int8) is not None
    monkeypatch.setattr(paged_attention, "PART_SLOTS", 4)  # one row's slots split between the threads too
    q, pool_k, pool_v, read, mask = scattered(rows, 24, 8, kv_heads, 16, seed=kv_heads)
    pool_k, pool_v = pool_k * torch.rand(pool_k.shape[:2])[..., None] * 4, pool_v * torch.rand(pool_v.shape[:2])[..., None]
    (k8, k_scale), (v8, v_scale) = quantize_rows(pool_k), quantize_rows(pool_v)
    want = gathered(q, dequantize_rows(k8, k_scale, torch.float32), dequantize_rows(v8, v_scale, torch.float32),
                    read, mask, 0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention.decode_attention(q, k8, v8, read, mask, 0.3, torch.full_like(q, float("nan")),
                                               (k_scale, v_scale))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert (out - gathered(q, pool_k, pool_v, read, mask, 0.3)).abs().max() > 1e-5  # the codes were read, not floats


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_an_fp32_engine_keeps_its_pool_in_the_kv_cache_dtype_and_decodes_as_generate_does(dtype, monkeypatch):
    """``kv_cache_dtype``: the pool holds bf16/fp16 (twice the blocks in the default budget) or int8
    codes and their scales (hd + 4 bytes a row against 4 * hd), the decoding rows read it in place,
    and the tokens are generate's with the same cache dtype."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8"}[dtype]
    pools = []
    real = paged_attention.decode_attention
    monkeypatch.setattr(paged_attention, "decode_attention",
                        lambda q, pk, *a, **kw: pools.append(pk.dtype) or real(q, pk, *a, **kw))
    model, ps = make(n_kv_heads=2), prompts(4)
    engine = Engine(model, TOK, block_size=4, max_num_batched_tokens=20, max_running=4, kv_cache_dtype=name)
    fp32_blocks, hd = Engine(model, TOK, block_size=4).blocks.num_blocks, model.cfg.d_model // model.cfg.n_heads
    ratio = 2 if dtype != torch.int8 else 4 * hd / (hd + 4)
    assert engine.blocks.num_blocks in (int(ratio * fp32_blocks), int(ratio * fp32_blocks) + 1)
    ours = staggered(engine, ps)
    assert ours == [generate(model, [p], 16, temperature=0, kv_cache_dtype=name)[0] for p in ps]
    assert len(pools) >= 16 * model.cfg.n_layers and set(pools) == {dtype}
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8'; expected one of auto, fp32, bf16, fp16"):
        Engine(model, TOK, kv_cache_dtype="fp8")


def test_an_encoder_decoders_int8_pool_gives_greedy_decodes_tokens_with_an_int8_cache():
    """Its decoder's self-attention keys as int8 codes in the pool (cross-attention keys stay in
    the model's dtype, as in the int8 ``KVCache``): each source's tokens are ``greedy_decode``'s."""
    model = make("encoder-decoder")
    sources = [p[:20] for p in prompts(6, seed=2)]
    ref = greedy_decode(model, [s + [EOS_ID] for s in sources], max_len=18, kv_cache_dtype="int8")
    engine = Engine(model, TOK, block_size=4, max_num_batched_tokens=8, kv_cache_dtype="int8")
    assert engine.runner.pool.k[0].dtype == torch.int8
    got = staggered(engine, sources, SamplingParams(max_tokens=18, temperature=0), every=1, source=True)
    assert got == [[t for t in r if t != EOS_ID] for r in ref]


def test_an_int8_pool_writes_codes_and_scales_and_gathers_them_dequantized():
    """What the prefill chunks read from an int8 pool: the keys and values written, to within half
    a scale of each slot's head, at the slots written; the other slots stay zero."""
    model = make(n_kv_heads=2)
    pool = PagedPool(model, num_blocks=4, block_size=4, dtype=torch.int8)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g) * 3
    slots = torch.tensor([3, 9, 10, 0, 14])
    pool.write(1, slots, k, v)
    assert pool.k[1].dtype == torch.int8 and pool.scales(0)[0].abs().sum() == 0
    read = torch.tensor([0, 3, 9, 10, 14, 16])  # 16: the dummy slot, never written
    gk, gv = pool.gathered(1, read, 2, 3, torch.float32)
    assert gk.shape == (2, 2, 3, 8) and gk.dtype == torch.float32
    order = torch.tensor([3, 0, 1, 2, 4])  # the written rows in read order
    for got, want, scale in ((gk, k, pool.k_scale[1]), (gv, v, pool.v_scale[1])):
        flat = got.transpose(1, 2).reshape(6, 2, 8)
        assert torch.all((flat[:5] - want[order]).abs() <= scale[read[:5]][..., None] / 2 + 1e-7)
        assert torch.equal(flat[5], torch.zeros(2, 8))
    assert PagedPool.bytes_per_block(model, 4, torch.int8) * 32 == PagedPool.bytes_per_block(model, 4) * (8 + 4)


def test_a_bf16_engines_decoding_rows_go_through_the_kernel_and_get_the_attention_of_the_pool():
    """Every decoding call of a bf16 engine's run reads the bf16 pool in place, and gives the
    fp32 attention over what the pool holds, rounded once to bf16. (Its tokens are not compared
    with the gathered path's: SDPA rounds the softmax weights to bf16 before multiplying by the
    values, so on a random model the two part at a near tie after a few tokens.)"""
    calls = []
    real = paged_attention.decode_attention

    def checked(q, pool_k, pool_v, read, mask, scale, out, scales=None):
        assert scales is None  # a float pool
        y = real(q, pool_k, pool_v, read, mask, scale, out)
        want = gathered(q.float(), pool_k.float(), pool_v.float(), read, mask, scale)
        calls.append((y.dtype, pool_k.dtype, (y.float() - want).abs().max().item(), want.abs().max().item()))
        return y

    model, ps = make(n_kv_heads=2), prompts(4)
    model = model.to(torch.bfloat16)
    try:
        paged_attention.decode_attention = checked
        staggered(Engine(model, TOK, block_size=4, max_num_batched_tokens=20, max_running=4), ps)
    finally:
        paged_attention.decode_attention = real
    assert len(calls) >= 16 * model.cfg.n_layers
    assert {(y, pool) for y, pool, _, _ in calls} == {(torch.bfloat16, torch.bfloat16)}
    assert max(err / scale for _, _, err, scale in calls) < 2**-8  # one bf16 rounding of the largest output


def test_decoding_rows_of_the_engine_go_through_the_kernel(monkeypatch):
    calls = []
    real = paged_attention.decode_attention
    monkeypatch.setattr(paged_attention, "decode_attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    model, ps = make(n_kv_heads=2), prompts(4)
    engine = Engine(model, TOK, block_size=4, max_num_batched_tokens=20, max_running=4)
    assert staggered(engine, ps) == alone(model, ps)
    assert len(calls) >= 16 * model.cfg.n_layers and max(calls) == 4  # every layer, all decoding rows at once


def test_without_a_compiler_the_engine_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    native.load.cache_clear()
    paged_attention.kernel.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="paged_attention: .*no C compiler.*torch's ops instead"):
            assert paged_attention.kernel() is None
        model, ps = make(), prompts(4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not at every step
            got = staggered(Engine(model, TOK, block_size=4, max_num_batched_tokens=20, max_running=4), ps)
        assert got == alone(model, ps)
    finally:
        native.load.cache_clear()
        paged_attention.kernel.cache_clear()


def test_a_compiler_that_fails_is_named_with_its_first_error_line_and_leaves_no_library(monkeypatch, tmp_path):
    cc = tmp_path / "broken-cc"
    cc.write_text("\n".join([
        "#!/bin/sh",
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo half > "$2"; shift; done',  # a partial output file
        "echo 'note: ignored' >&2",
        "echo 'kernel.c:3: error: no such type' >&2",
        "echo 'kernel.c:9: error: later' >&2",
        "exit 1", ""]))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    native.load.cache_clear()
    try:
        said = r"paged_attention: .*broken-cc failed: kernel.c:3: error: no such type"
        with pytest.warns(RuntimeWarning, match=said):
            assert native.load("paged_attention") is None
        assert not list((tmp_path / "cache").rglob("*paged_attention*"))  # no half-written library left behind
    finally:
        native.load.cache_clear()


def test_the_kernels_split_their_work_on_torchs_own_openmp_runtime():
    """A kernel's threads are torch's (waking them costs microseconds; a Python thread pool
    of their own cost 140 us a call): each library is linked against libgomp.so.1, and a
    process with torch and the kernels loaded holds one OpenMP runtime, the one torch loaded
    (checked in a fresh process: other packages of the suite may bring their own)."""
    probe = ("from pathlib import Path; from blockformer import native\n"
             "libs = [native.load(n) for n in ('paged_attention', 'f32_matmul', 'int8_matmul', 'int4_matmul')]\n"
             "assert all(lib is not None and b'libgomp.so.1' in Path(lib._name).read_bytes() for lib in libs)\n"
             "maps = Path('/proc/self/maps').read_text().splitlines()\n"
             "print(len({line.split()[-1] for line in maps if 'libgomp' in line}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "1"  # torch's own (its wheel bundles libgomp.so.1), not a second beside it


def test_the_kernel_is_built_for_the_instruction_set_torch_is_capped_at(monkeypatch):
    if native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 flags")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert native.arch_flags() == ["-mavx2", "-mfma", "-mf16c"]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert native.arch_flags() == []
