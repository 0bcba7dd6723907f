"""Matmul weights packed for the CPU kernel: the same products, the same greedy tokens,
and a clear refusal where a packed weight cannot go (gradients, a compiled step)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockformer import TransformerConfig, build_model, kernels, native
from blockformer.generate import PackedLinear, generate, pack_linears, prepare_for_decoding
from blockformer.generate import packed as packed_module
from blockformer.generate.packed import StreamedLinear
from blockformer.generate.quantize import Int8Linear

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packed_module.can_pack(d)]
needs_packing = pytest.mark.skipif(not DTYPES, reason="this torch/CPU does not pack linear weights (see can_pack)")
PACKS = {torch.float32: "fp32", torch.bfloat16: "bf16"}[DTYPES[0]] if DTYPES else None  # a precision that packs here


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
    model = pack_linears(_decoder().to(DTYPES[0]))
    with pytest.raises(ValueError, match="packed for eager CPU decoding"):
        generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0, compile=True)


@needs_packing
def test_prepare_for_decoding_packs_only_unquantized_models():
    assert any(isinstance(m, PackedLinear) for m in prepare_for_decoding(_decoder(), PACKS, pack=True).modules())
    quantized = prepare_for_decoding(_decoder(), PACKS, "int8", pack=True)
    assert not any(isinstance(m, PackedLinear) for m in quantized.modules())
    assert any(isinstance(m, Int8Linear) for m in quantized.modules())
    assert not any(isinstance(m, PackedLinear) for m in prepare_for_decoding(_decoder(), PACKS).modules())


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


def count_f32_kernel_calls(monkeypatch) -> list[int]:
    """Rows of each call into csrc/f32_matmul.c from now on."""
    calls = []
    real = packed_module._f32_matmul()
    assert real is not None  # a C compiler is part of the set-up (README)
    monkeypatch.setattr(packed_module, "_f32_matmul", lambda: lambda *a: calls.append(a[4]) or real(*a))
    monkeypatch.setattr(native, "CPP_OPS", False)  # the Python operators, which call the counted function
    return calls


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_a_streamed_linear_takes_few_rows_through_its_kernel_and_computes_the_linear(bias, threads, monkeypatch):
    calls = count_f32_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    linear = nn.Linear(200, 77, bias=bias)  # widths no vector divides
    streamed = StreamedLinear.of(linear)
    assert streamed.weight is linear.weight  # shared, not copied
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for shape in ((1, 200), (2, 2, 200), (4, 200), (5, 200), (3, 4, 200), (16, 200), (17, 200)):
                x = torch.randn(shape)
                torch.testing.assert_close(streamed(x), linear(x), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)
    assert calls == [1, 4, 4, 5, 12, 16]  # up to STREAM_ROWS (16) rows in the kernel; 17 rows are F.linear's
    x = torch.randn(1, 200, requires_grad=True)
    streamed(x).sum().backward()  # training: F.linear, with gradients
    assert calls == [1, 4, 4, 5, 12, 16] and x.grad is not None


@pytest.mark.parametrize("threads", [1, 2])
def test_the_f32_kernel_computes_the_linear_at_any_rows(threads):
    """Row blocks of 4 over 16-channel chunks (csrc/rows.h), with ragged last ones; within a
    chunk, channels 4 at a time and then one at a time (77 channels leave ragged chunks at 1
    and 2 threads), inputs 8 at a time with a tail (203)."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, rows in itertools.product((200, 203), (1, 3, 4, 5, 7, 9, 17, 33)):
            w, b, x = torch.randn(77, k), torch.randn(77), torch.randn(rows, k)
            torch.testing.assert_close(packed_module.f32_matmul(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(packed_module.f32_matmul(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_where_fp32_does_not_pack_its_linears_stream_and_decode_the_same_tokens_eager_and_compiled(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_has", lambda probe: False)  # a CPU with AVX2 alone
    packed_module.can_pack.cache_clear()
    try:
        model = _decoder()
        prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
        plain = generate(model, prompt, 12, temperature=0)
        pack_linears(model)
        assert sum(isinstance(m, StreamedLinear) for m in model.modules()) == 2 * 4 + 1
        assert not any(isinstance(m, StreamedLinear) for m in pack_linears(_decoder().to(torch.bfloat16)).modules())
        calls = count_f32_kernel_calls(monkeypatch)
        assert generate(model, prompt, 12, temperature=0) == plain
        eager_calls = len(calls)
        assert eager_calls == 11 * 9 + 9  # 11 one-row steps after the prompt, 9 linears each; the 6-row prompt's
        # 8 block linears and its head (at the last position)
        assert generate(model, prompt, 12, temperature=0, compile=True) == plain  # the kernel as a custom op
        assert len(calls) > eager_calls
    finally:
        packed_module.can_pack.cache_clear()


@pytest.mark.parametrize("amx", [False, True])
def test_a_model_packed_for_a_compiled_step_keeps_weights_the_step_can_read(monkeypatch, amx):
    monkeypatch.setattr(packed_module, "can_pack", lambda dtype: True)  # a CPU where oneDNN packing pays
    monkeypatch.setattr(kernels, "cpu_has", lambda probe: amx and probe == "_is_amx_tile_supported")
    assert any(isinstance(m, PackedLinear) for m in pack_linears(_decoder()).modules())  # eager: packed
    model = pack_linears(_decoder(), compiled=True)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    # without AMX a compiled step streams its fp32 products (1.8x F.linear on an AVX512-BF16 EPYC); AMX keeps F.linear
    assert sum(isinstance(m, StreamedLinear) for m in model.modules()) == (0 if amx else 2 * 4 + 1)
    prompt = torch.tensor([[1, 2, 3]])
    assert generate(model, prompt, 4, temperature=0, compile=True) == generate(_decoder(), prompt, 4, temperature=0)


@pytest.mark.parametrize("amx", [False, True])
def test_a_step_of_few_rows_streams_the_fp32_weights_that_would_pack(monkeypatch, amx):
    """``rows``: where every step has STREAM_OVER_PACKED_ROWS rows or fewer (``generate``'s one prompt), fp32 weights
    stream through the C kernel on a CPU that would pack them (it decoded faster there at batch 1);
    more rows, or rows not known, pack; bf16 packs (the kernel is fp32), and an AMX CPU streams nothing."""
    real = packed_module.can_pack  # bf16 packs where this CPU can (not under an AVX2 cap)
    monkeypatch.setattr(packed_module, "can_pack", lambda dtype: dtype == torch.float32 or real(dtype))  # fp32: AVX-512
    monkeypatch.setattr(kernels, "cpu_has", lambda probe: amx and probe == "_is_amx_tile_supported")
    few = kernels.STREAM_OVER_PACKED_ROWS
    for rows, packs in ((1, amx), (few, amx), (few + 1, True), (None, True)):
        model = pack_linears(_decoder(), rows=rows)
        assert sum(isinstance(m, PackedLinear) for m in model.modules()) == (2 * 4 + 1 if packs else 0), rows
        assert sum(isinstance(m, StreamedLinear) for m in model.modules()) == (0 if packs else 2 * 4 + 1), rows
    assert all(not isinstance(m, StreamedLinear) for m in pack_linears(_decoder().to(torch.bfloat16), rows=1).modules())
    model = prepare_for_decoding(_decoder(), "fp32", pack=True, rows=1)
    assert any(isinstance(m, StreamedLinear) for m in model.modules()) != amx
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])  # a prompt of more rows than the kernel takes: F.linear, then 1-row steps
    assert generate(model, prompt, 6, temperature=0) == generate(_decoder(), prompt, 6, temperature=0)
