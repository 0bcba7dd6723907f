"""csrc/decode_attention.c: one new token per row over every cached slot equals SDPA, and the
eager CPU decode step takes it exactly where its mask would be all True."""

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
            torch.testing.assert_close(DECODE.decode_attention(q, k, v, 0.3), want, rtol=1e-5, atol=5e-5)  # values ~3


def test_the_cpp_operator_gives_the_same_and_checks_its_shapes():
    assert DECODE.kernel() is not None and native.CPP_OPS
    q, k, v = torch.randn(2, 4, 1, 32), torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)
    torch.testing.assert_close(torch.ops.blockformer_c.decode_attention(q, k, v, 0.25),
                               DECODE.decode_attention(q, k, v, 0.25), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="expected q"):
        torch.ops.blockformer_c.decode_attention(q, k[:, :, :, :16], v[:, :, :, :16], 0.25)


def make():
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                            max_seq_len=64, position="rope", tie_embeddings=False, init_std=0.5)
    return build_model(cfg, seed=0).eval()


def test_eager_decoding_takes_the_kernel_at_each_unpadded_step_and_gives_sdpas_tokens(monkeypatch):
    model, calls = make(), []
    call = native.call
    monkeypatch.setattr(ATTENTION.native, "call", lambda fn, *a: calls.append(fn.__name__) or call(fn, *a))
    ours = generate(model, [[5, 6, 7]], 6, temperature=0)
    assert calls == ["decode_attention"] * 3 * 5  # each layer of the 5 steps after the prompt's
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", False)
    assert generate(model, [[5, 6, 7]], 6, temperature=0) == ours
    assert len(calls) == 15

    calls.clear()  # a left-padded batch keeps SDPA and its mask
    monkeypatch.setattr(kernels, "DECODE_ATTENTION_KERNEL", True)
    generate(model, [[5, 6, 7], [8]], 4, temperature=0)
    assert calls == []


def test_the_choice_is_fp32_inference_on_one_query_token():
    q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 4, 9, 32)
    with torch.inference_mode():
        assert kernels.decode_attention_kernel(q, k, k)
        assert not kernels.decode_attention_kernel(q.bfloat16(), k.bfloat16(), k.bfloat16())
        assert not kernels.decode_attention_kernel(torch.randn(1, 4, 2, 32), k, k)  # two query tokens
        assert not kernels.decode_attention_kernel(q, k.transpose(2, 3), k.transpose(2, 3))  # slots not contiguous
    assert not kernels.decode_attention_kernel(q, k, k)  # autograd on: the kernel has no backward
