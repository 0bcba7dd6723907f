"""csrc/decode_attention.c: one new token per row over the cached slots its key mask keeps equals
SDPA, over a cache of fp32, bf16 or fp16, and decoding on a CPU takes it at every step: unpadded,
padded, across to a source, and compiled."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from blockformer import TransformerConfig, build_model, kernels, native
from blockformer.generate import generate
from blockformer.nn import attention as ATTENTION
from blockformer.nn import decode_attention as DECODE
from native_builds import kernels_built_for

SHAPES = [  # B, H, H_kv, S, D: GQA, one slot, widths the AVX2 body takes (32, 64, 128) and not (48)
    (1, 12, 12, 80, 64), (2, 4, 2, 7, 32), (3, 6, 3, 1, 48), (1, 8, 2, 300, 128), (2, 2, 1, 33, 16)]


@pytest.mark.parametrize("cap", [None, "avx2", "default"])  # this CPU's build, AVX2's, plain C
def test_the_kernel_equals_sdpa_over_a_slice_of_a_longer_cache(cap, monkeypatch):
    with kernels_built_for(cap, monkeypatch, DECODE.kernel):
        assert DECODE.kernel() is not None
        g = torch.Generator().manual_seed(0)
        for B, H, Hkv, S, D in SHAPES:
            q = torch.randn(B, H, 1, D, generator=g)
            cache_k, cache_v = torch.randn(2, B, Hkv, S + 9, D, generator=g) * 3  # the first S slots are read
            k, v = cache_k[:, :, :S], cache_v[:, :, :S]
            want = F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv, scale=0.3)
            torch.testing.assert_close(DECODE.decode_attention(q, k, v, None, 0.3), want, rtol=1e-5, atol=5e-5)  # values ~3


@pytest.mark.parametrize("cap", [None, "avx2", "default"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_reads_a_narrow_cache_as_sdpa_reads_it_widened(cap, dtype, monkeypatch):
    """Each value is widened exactly (bf16 by a shift, fp16 by F16C or by hand in plain C), so the
    kernel equals SDPA over the cache converted to fp32 as closely as over an fp32 cache. fp16's
    extremes, as values: subnormals (6e-8, 1e-5) and zeros of both signs on their own scale, then
    its largest (65504)."""
    with kernels_built_for(cap, monkeypatch, DECODE.kernel):
        g = torch.Generator().manual_seed(1)
        extremes = [[6e-8, -1e-5, 3e-5, 0.0, -0.0, 1e-7], [65504.0, -65504.0, 1.0, 0.0, 2.0, -3.0]]
        for B, H, Hkv, S, D in SHAPES:
            q = torch.randn(B, H, 1, D, generator=g)
            cache_k, cache_v = (torch.randn(2, B, Hkv, S + 9, D, generator=g) * 3).to(dtype)
            for values in [None, *extremes] if dtype == torch.float16 else [None]:
                if values is not None:
                    n = cache_v.numel()
                    cache_v = torch.tensor(values, dtype=dtype).repeat(n // 6 + 1)[:n].view(cache_v.shape)
                k, v = cache_k[:, :, :S], cache_v[:, :, :S]
                want = F.scaled_dot_product_attention(q, k.float(), v.float(), enable_gqa=H != Hkv, scale=0.3)
                atol = 5e-5 * max(v.float().abs().amax().item(), 1e-30) / 3  # for values ~3, as over fp32
                torch.testing.assert_close(DECODE.decode_attention(q, k, v, None, 0.3), want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("cap", [None, "avx2", "default"])
def test_the_kernel_reads_an_int8_cache_as_its_codes_times_their_scales(cap, monkeypatch):
    """Codes at the extremes (-127, 127) and at random, each slot's scale its own (one of them 0, a
    row of zeros), with and without a key mask: the kernel equals SDPA over the dequantized cache;
    ``quantize_rows`` keeps each value to within half its row's scale."""
    from blockformer.nn.kv_cache import dequantize_rows, quantize_rows

    with kernels_built_for(cap, monkeypatch, DECODE.kernel):
        g = torch.Generator().manual_seed(3)
        for B, H, Hkv, S, D in SHAPES:
            q = torch.randn(B, H, 1, D, generator=g)
            k, v = torch.randn(2, B, Hkv, S + 9, D, generator=g) * 3
            k[..., 0, :] = 0.0  # slot 0: scale 0
            (kc, ks), (vc, vs) = quantize_rows(k), quantize_rows(v)
            assert (dequantize_rows(kc, ks, torch.float32) - k).abs().le(ks[..., None] / 2 + 1e-6).all()
            assert kc.abs().amax(-1)[..., 1:].eq(127).all() and ks[..., 0].eq(0).all()
            keep = torch.rand(B, 1, 1, S, generator=g) < 0.6
            keep[..., -1] = True
            for mask in (None, keep):
                k_, v_ = kc[:, :, :S], vc[:, :, :S]  # the first S slots of a longer cache
                want = F.scaled_dot_product_attention(q, dequantize_rows(k_, ks[:, :, :S], torch.float32),
                                                      dequantize_rows(v_, vs[:, :, :S], torch.float32),
                                                      attn_mask=mask, enable_gqa=H != Hkv, scale=0.3)
                out = DECODE.decode_attention(q, k_, v_, mask, 0.3, ks[:, :, :S], vs[:, :, :S])
                torch.testing.assert_close(out, want, rtol=1e-5, atol=5e-5)
            with pytest.raises(ValueError, match="k_scale, v_scale: expected both with an int8 cache"):
                DECODE.decode_attention(q, kc[:, :, :S], vc[:, :, :S], None, 0.3)


@pytest.mark.parametrize("cap", [None, "avx2", "default"])
def test_every_bf16_and_fp16_value_is_widened_exactly(cap, monkeypatch):
    """One slot: the output is its value times a weight of exactly 1. Every 16-bit pattern of each type
    (infinities, NaNs, subnormals), through the vector body (D = 65536) and the plain loop (D = 65520)."""
    with kernels_built_for(cap, monkeypatch, DECODE.kernel):
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
        for dtype in (torch.bfloat16, torch.float16):
            for D in (65536, 65520):
                v = every[:D].view(dtype).view(1, 1, 1, D)
                out = DECODE.decode_attention(torch.zeros(1, 1, 1, D), torch.zeros_like(v), v, None, 1.0)
                torch.testing.assert_close(out, v.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("cap", [None, "avx2", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_skips_the_slots_a_key_mask_hides_as_sdpa_does(cap, dtype, monkeypatch):
    """SDPA's bool key mask, one row per batch row or one for all, contiguous or not: the masked slots
    hold NaN and inf, which SDPA's weights of 0 would not remove (0 * inf) and the kernel never reads.
    A row with every slot masked gives zeros."""
    with kernels_built_for(cap, monkeypatch, DECODE.kernel):
        g = torch.Generator().manual_seed(2)
        for B, H, Hkv, S, D in SHAPES:
            q = torch.randn(B, H, 1, D, generator=g)
            k, v = (torch.randn(2, B, Hkv, S, D, generator=g) * 3).to(dtype)
            for rows in (B, 1):
                keep = torch.rand(rows, 1, 1, S, generator=g) < 0.7
                keep[..., 0] = True  # every row keeps a slot
                wide = torch.zeros(rows, 1, 1, 2 * S, dtype=torch.bool)
                wide[..., ::2] = keep  # the same mask, its slots two bytes apart
                want = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=keep, enable_gqa=H != Hkv,
                                                      scale=0.3)
                hidden_k, hidden_v = k.masked_fill(~keep.transpose(2, 3), float("nan")), v.masked_fill(
                    ~keep.transpose(2, 3), float("inf"))
                for mask in (keep, wide[..., ::2]):
                    out = DECODE.decode_attention(q, hidden_k, hidden_v, mask, 0.3)
                    torch.testing.assert_close(out, want, rtol=1e-5, atol=5e-5)
            none = torch.zeros(B, 1, 1, S, dtype=torch.bool)
            none[0] = True  # row 0 sees every slot, the others none
            out = DECODE.decode_attention(q, k, v, none, 0.3)
            assert out[1:].abs().max() == 0 if B > 1 else True
            torch.testing.assert_close(out[:1], DECODE.decode_attention(q[:1], k[:1], v[:1], None, 0.3))
            with pytest.raises(ValueError, match=r"mask: \(1, 1, 2, \d+\) torch.bool; expected bool \(B or 1, 1, 1, "):
                DECODE.decode_attention(q, k, v, torch.ones(1, 1, 2, S, dtype=torch.bool), 0.3)


def test_the_cpp_operator_gives_the_same_and_checks_its_shapes():
    assert DECODE.kernel() is not None and native.CPP_OPS
    q, k, v = torch.randn(2, 4, 1, 32), torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)
    torch.testing.assert_close(torch.ops.blockformer_c.decode_attention(q, k, v, None, 0.25, None, None),
                               DECODE.decode_attention(q, k, v, None, 0.25), rtol=0, atol=0)
    keep = torch.rand(2, 1, 1, 20) < 0.5
    keep[..., 0] = True
    for mask in (keep[..., :10], keep[..., ::2], keep[:1, ..., :10]):  # rows apart, slots apart, one for all
        torch.testing.assert_close(torch.ops.blockformer_c.decode_attention(q, k, v, mask, 0.25, None, None),
                                   DECODE.decode_attention(q, k, v, mask, 0.25), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="expected q"):
        torch.ops.blockformer_c.decode_attention(q, k[:, :, :, :16], v[:, :, :, :16], None, 0.25, None, None)
    with pytest.raises(RuntimeError, match=r"expected a bool mask \(B or 1, 1, 1, S\)"):
        torch.ops.blockformer_c.decode_attention(q, k, v, keep[..., :10].float(), 0.25, None, None)
    with pytest.raises(RuntimeError, match=r"expected a bool mask \(B or 1, 1, 1, S\)"):
        torch.ops.blockformer_c.decode_attention(q, k, v, keep, 0.25, None, None)  # 20 slots, not 10
    for dtype in (torch.bfloat16, torch.float16):
        torch.testing.assert_close(torch.ops.blockformer_c.decode_attention(q, k.to(dtype), v.to(dtype), None, 0.25, None,
                                                                            None),
                                   DECODE.decode_attention(q, k.to(dtype), v.to(dtype), None, 0.25), rtol=0, atol=0)
    codes, scales = (k * 20).round().clamp(-127, 127).to(torch.int8), torch.rand(2, 2, 10) / 20
    mask = keep[..., :10]
    torch.testing.assert_close(torch.ops.blockformer_c.decode_attention(q, codes, codes, mask, 0.25, scales, scales),
                               DECODE.decode_attention(q, codes, codes, mask, 0.25, scales, scales), rtol=0, atol=0)
    for wrong in [(q, codes, codes, None, 0.25, None, None), (q, k, v, None, 0.25, scales, scales)]:
        with pytest.raises(RuntimeError, match="expected k_scale and v_scale both with an int8 cache"):
            torch.ops.blockformer_c.decode_attention(*wrong)
    with pytest.raises(RuntimeError, match=r"expected fp32 k_scale and v_scale \(B, H_kv, S\)"):
        torch.ops.blockformer_c.decode_attention(q, codes, codes, None, 0.25, scales[:, :, :9], scales[:, :, :9])
    for wrong in [(q, k.bfloat16(), v.half()), (q.bfloat16(), k.bfloat16(), v.bfloat16()), (q, k.double(), v.double())]:
        with pytest.raises(RuntimeError, match="expected an fp32 q, and k, v both fp32, bf16, fp16 or int8"):
            torch.ops.blockformer_c.decode_attention(*wrong, None, 0.25, None, None)


def make():
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                            max_seq_len=64, position="rope", tie_embeddings=False, init_std=0.5)
    return build_model(cfg, seed=0).eval()


def test_eager_decoding_takes_the_kernel_at_every_step_padded_or_not_and_gives_sdpas_tokens(monkeypatch):
    model, calls = make(), []
    call = native.call
    monkeypatch.setattr(ATTENTION.native, "call", lambda fn, *a: calls.append(fn.__name__) or call(fn, *a))
    ours = generate(model, [[5, 6, 7]], 6, temperature=0)
    assert calls == ["decode_attention"] * 3 * 5  # each layer of the 5 steps after the prompt's
    padded = generate(model, [[5, 6, 7], [8]], 4, temperature=0)  # left-padded: the kernel with its key mask
    assert calls == ["decode_attention"] * 3 * (5 + 3)
    assert padded == [ours[0][:4], generate(model, [[8]], 4, temperature=0)[0]]  # the padding unseen
    calls.clear()
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", False)
    assert generate(model, [[5, 6, 7]], 6, temperature=0) == ours
    assert generate(model, [[5, 6, 7], [8]], 4, temperature=0) == padded
    assert calls == []


def test_the_choice_is_fp32_inference_on_one_query_token():
    q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 4, 9, 32)
    with torch.inference_mode():
        assert kernels.decode_attention_kernel(q, k, k)
        assert not kernels.decode_attention_kernel(q.bfloat16(), k.bfloat16(), k.bfloat16())
        assert kernels.decode_attention_kernel(q, k.bfloat16(), k.bfloat16())  # a narrow cache, fp32 queries
        assert kernels.decode_attention_kernel(q, k.half(), k.half())
        assert not kernels.decode_attention_kernel(q, k.bfloat16(), k.half())
        assert not kernels.decode_attention_kernel(q, k.double(), k.double())
        assert kernels.decode_attention_kernel(q, k.to(torch.int8), k.to(torch.int8))  # an int8 cache, with its scales
        assert not kernels.decode_attention_kernel(torch.randn(1, 4, 2, 32), k, k)  # two query tokens
        assert not kernels.decode_attention_kernel(q, k.transpose(2, 3), k.transpose(2, 3))  # slots not contiguous
        for keys in [(1, 1, 1, 9), (3, 1, 1, 9)]:  # a key mask: one row for all, or one per row
            assert kernels.decode_attention_kernel(q.expand(3, -1, -1, -1), k.expand(3, -1, -1, -1),
                                                   k.expand(3, -1, -1, -1), torch.ones(keys, dtype=torch.bool))
        for mask in [torch.ones(1, 1, 1, 9), torch.ones(1, 4, 1, 9, dtype=torch.bool),  # a bias; one per head
                     torch.ones(1, 1, 1, 8, dtype=torch.bool), torch.ones(2, 1, 1, 9, dtype=torch.bool)]:
            assert not kernels.decode_attention_kernel(q, k, k, mask)
    assert not kernels.decode_attention_kernel(q, k, k)  # autograd on: the kernel has no backward


NARROW = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "int8"])
def test_a_narrow_cache_holds_its_dtype_and_each_path_reads_it_alike(dtype, monkeypatch):
    """kv_cache_dtype: the cache holds bf16/fp16/int8 under an fp32 model; the eager step's kernel reads it
    in place and SDPA (the kernel off, or a padded batch's mask) an fp32 copy: the same tokens. Its
    logits differ from an fp32 cache's by the rounding alone (measured here: 0.092 for bf16, 0.0046 for
    fp16, 0.24 for int8, on logits up to 9.1; an unrounded cache would give 0, one read as the wrong type
    or without its scales far more)."""
    from blockformer.nn.kv_cache import KVCache

    model, held, calls = make(), set(), []
    update, call = KVCache.update, native.call
    monkeypatch.setattr(KVCache, "update", lambda self, *a: held.add(self.dtype) or update(self, *a))
    monkeypatch.setattr(ATTENTION.native, "call", lambda fn, *a: calls.append(fn.__name__) or call(fn, *a))
    ours = generate(model, [[5, 6, 7]], 6, temperature=0, kv_cache_dtype=dtype)
    assert held == {NARROW[dtype]} and len(calls) == 15
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", False)
    assert generate(model, [[5, 6, 7]], 6, temperature=0, kv_cache_dtype=dtype) == ours
    assert generate(model, [[5, 6, 7], [8]], 6, temperature=0, kv_cache_dtype=dtype)[0] == ours[0]
    assert len(calls) == 15

    with torch.inference_mode():  # the logits of one step, fp32 cache against narrow
        logits = {}
        for name in ("fp32", dtype):
            cache = model.new_cache(1, 8, dtype=NARROW[name])
            ids = torch.tensor([[5, 6, 7, 9, 11]])
            model(ids[:, :4], cache=cache, cache_pos=torch.arange(4))
            logits[name] = model(ids[:, 4:], cache=cache, cache_pos=torch.tensor([4]))[0, -1]
        gap = (logits[dtype] - logits["fp32"]).abs().max().item()
        assert 0 < gap < {"bf16": 0.02, "fp16": 0.002, "int8": 0.04}[dtype] * logits["fp32"].abs().max().item(), gap


def test_a_compiled_step_takes_the_kernel_and_never_reads_the_slots_it_has_not_written(monkeypatch):
    """Under torch.compile the step attends over every slot of its cache, with a mask; through the
    kernel a masked slot is not read. The cache's slots start as NaN: SDPA's weights of 0 keep them
    (0 * NaN), so with the kernel off the compiled step's logits would be NaN. A bf16 cache, a padded
    batch: the compiled tokens are the eager ones."""
    from blockformer.generate import step as STEP
    from blockformer.nn.kv_cache import KVCache

    assert DECODE.kernel() is not None and native.CPP_OPS
    init = KVCache.__init__

    def nan_cache(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for t in [*self.k, *self.v, *(self.k_scale or []), *(self.v_scale or [])]:
            t.fill_(127 if t.dtype == torch.int8 else float("nan"))  # int8: the scales are NaN

    monkeypatch.setattr(KVCache, "__init__", nan_cache)
    model, prompts = make(), [[5, 6, 7], [8]]
    monkeypatch.setattr(STEP, "_COMPILED", {})
    for kv in ("bf16", "int8"):
        eager = generate(model, prompts, 6, temperature=0, kv_cache_dtype=kv)
        assert eager == [generate(model, [p], 6, temperature=0, kv_cache_dtype=kv)[0] for p in prompts]
        assert generate(model, prompts, 6, temperature=0, kv_cache_dtype=kv, compile=True) == eager


def test_seq2seq_decoding_attends_to_its_source_through_the_kernel(monkeypatch):
    """Greedy and beam decoding of an encoder-decoder: self-attention over the target's cache and
    cross-attention over the padded sources' keys both take the kernel, with the source's key mask,
    and give SDPA's tokens."""
    from blockformer.generate import beam_search, greedy_decode

    cfg = TransformerConfig(arch="encoder-decoder", vocab_size=40, d_model=64, n_layers=2, n_heads=4,
                            max_seq_len=32, position="sinusoidal", init_std=0.5)
    model, calls, call = build_model(cfg, seed=0).eval(), [], native.call
    monkeypatch.setattr(ATTENTION.native, "call", lambda fn, *a: calls.append(fn.__name__) or call(fn, *a))
    sources = [[5, 6, 7, 8, 9, 10], [11, 12]]
    greedy, beams = greedy_decode(model, sources, max_len=8), beam_search(model, sources, beam_size=3, max_len=8)
    assert calls.count("decode_attention") >= 2 * 2 * 7  # self and cross, in each layer, at each step
    assert greedy[1] == greedy_decode(model, sources[1:], max_len=8)[0]  # the padding unseen
    calls.clear()
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", False)
    assert greedy_decode(model, sources, max_len=8) == greedy
    sdpa_beams = beam_search(model, sources, beam_size=3, max_len=8)
    assert [[h.tokens for h in b] for b in sdpa_beams] == [[h.tokens for h in b] for b in beams]
    assert [h.log_prob for b in sdpa_beams for h in b] == pytest.approx([h.log_prob for b in beams for h in b], 1e-5)
    assert calls == []


def test_seq2seq_and_speculative_decoding_keep_the_cache_in_the_dtype_asked_for(monkeypatch):
    """kv_cache_dtype in greedy and beam decoding (the cross-attention keys too) and in speculative
    decoding (both caches): every decode step reads bf16 keys, and the kernel and SDPA give the same
    tokens; speculative greedy decoding gives ``generate``'s tokens over the same narrow cache."""
    from blockformer.generate import beam_search, greedy_decode, speculative_generate

    cfg = TransformerConfig(arch="encoder-decoder", vocab_size=40, d_model=64, n_layers=2, n_heads=4,
                            max_seq_len=32, position="sinusoidal", init_std=0.5)
    seq2seq, read = build_model(cfg, seed=0).eval(), []
    sdpa = ATTENTION.sdpa
    monkeypatch.setattr(ATTENTION, "sdpa", lambda q, k, *a: (q.shape[2] == 1 and read.append(k.dtype)) or sdpa(q, k, *a))
    sources = [[5, 6, 7, 8, 9, 10], [11, 12]]
    greedy = greedy_decode(seq2seq, sources, max_len=8, kv_cache_dtype="bf16")
    beams = beam_search(seq2seq, sources, beam_size=3, max_len=8, kv_cache_dtype="bf16")
    assert len(read) >= 2 * 2 * 7 and set(read) == {torch.bfloat16}, set(read)  # self and cross, each step
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", False)
    assert greedy_decode(seq2seq, sources, max_len=8, kv_cache_dtype="bf16") == greedy
    assert [[h.tokens for h in b] for b in beam_search(seq2seq, sources, beam_size=3, max_len=8,
                                                       kv_cache_dtype="bf16")] == [[h.tokens for h in b] for b in beams]
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", True)

    read.clear()
    target, draft = make(), build_model(dataclasses.replace(make().cfg, n_layers=1), seed=1).eval()
    out = speculative_generate(target, draft, [[5, 6, 7], [8]], 8, temperature=0, kv_cache_dtype="fp16")
    assert read and set(read) == {torch.float16}
    assert out.tokens == generate(target, [[5, 6, 7], [8]], 8, temperature=0, kv_cache_dtype="fp16")
    int8 = greedy_decode(seq2seq, sources, max_len=8, kv_cache_dtype="int8")  # cross-attention keys stay fp32
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", False)
    assert greedy_decode(seq2seq, sources, max_len=8, kv_cache_dtype="int8") == int8
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8'; expected one of auto, fp32, bf16, fp16, int8"):
        greedy_decode(seq2seq, sources, max_len=8, kv_cache_dtype="fp8")


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int4'; expected one of auto, fp32, bf16, fp16, int8"):
        generate(make(), [[5, 6]], 2, temperature=0, kv_cache_dtype="int4")
