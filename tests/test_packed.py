"""Matmul weights packed for the CPU kernel: the same products, the same greedy tokens,
and a clear refusal where a packed weight cannot go (gradients, a compiled step)."""

import pytest
import torch
from torch import nn

from blockformer import TransformerConfig, build_model, kernels
from blockformer.generate import PackedLinear, generate, pack_linears, prepare_for_decoding
from blockformer.generate import packed as packed_module
from blockformer.generate.quantize import Int8Linear

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packed_module.can_pack(d)]
needs_packing = pytest.mark.skipif(not DTYPES, reason="this torch/CPU does not pack linear weights (see can_pack)")


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_linear_computes_the_linear(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        for shape in ((1, 48), (16, 48), (2, 5, 48)):
            x = torch.randn(shape).to(dtype)
            torch.testing.assert_close(packed(x).float(), linear(x).float(), atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="for inference"):
        packed(torch.randn(1, 48).to(dtype))  # gradients on: refused, not silently wrong


def _decoder():
    cfg = TransformerConfig(arch="decoder", vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                            position="learned", init_std=0.2)
    return build_model(cfg, seed=0).eval()


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_decoder_generates_the_same_tokens(dtype):
    model = _decoder().to(dtype)
    prompt = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(1))
    plain = generate(model, prompt, 24, temperature=0)
    with torch.inference_mode():
        plain_logits = model(prompt)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    pack_linears(model)
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == n_linear == 2 * 4 + 1  # qkv, out, 2 FFN; head
    assert generate(model, prompt, 24, temperature=0) == plain
    with torch.inference_mode():
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(model(prompt).float(), plain_logits.float(), atol=tol, rtol=tol)
    assert model.embed.tokens.weight.dtype == dtype  # the tied embedding is still a plain table


@needs_packing
def test_a_compiled_step_refuses_a_packed_model():
    model = pack_linears(_decoder())
    with pytest.raises(ValueError, match="packed for eager CPU decoding"):
        generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0, compile=True)


@needs_packing
def test_prepare_for_decoding_packs_only_unquantized_models():
    assert any(isinstance(m, PackedLinear) for m in prepare_for_decoding(_decoder(), "fp32", pack=True).modules())
    quantized = prepare_for_decoding(_decoder(), "fp32", "int8", pack=True)
    assert not any(isinstance(m, PackedLinear) for m in quantized.modules())
    assert any(isinstance(m, Int8Linear) for m in quantized.modules())
    assert not any(isinstance(m, PackedLinear) for m in prepare_for_decoding(_decoder(), "fp32").modules())


@pytest.mark.parametrize("unavailable", ["onednn", "cpu"])
def test_nothing_is_packed_where_packing_is_not_available_or_not_measured(monkeypatch, unavailable):
    if unavailable == "onednn":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    else:  # a CPU with AVX2 alone: no AVX-512, no bf16 units
        monkeypatch.setattr(kernels, "cpu_has", lambda probe: False)
    packed_module.can_pack.cache_clear()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model = pack_linears(_decoder().to(dtype))
            assert not any(isinstance(m, PackedLinear) for m in model.modules())
    finally:
        packed_module.can_pack.cache_clear()
