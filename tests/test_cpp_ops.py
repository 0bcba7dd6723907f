"""csrc/ops.cpp: the decode products' C++ operators (torch.ops.blockformer_c), which an eager
layer or a compiled step calls instead of a Python function around the same C kernels."""

import warnings

import pytest
import torch
from torch import nn

from blockformer import TransformerConfig, build_model, kernels, native
from blockformer.generate import generate, pack_linears, prepare_for_decoding, quantize
from blockformer.generate.packed import StreamedLinear, f32_matmul
from blockformer.generate.quantize import (Int4Linear, Int8Linear, int4_a8_matmul, int4_matmul, int8_a8_matmul,
                                           int8_matmul)


@pytest.fixture(scope="module")
def loaded():
    assert native.load_cpp_ops()  # a C++ compiler is part of the set-up (inductor needs one too)
    assert native.CPP_OPS


def cases():
    torch.manual_seed(0)
    linear, int8, int4 = nn.Linear(200, 77), Int8Linear(nn.Linear(200, 77)), Int4Linear(nn.Linear(192, 50), 64)
    int8_224 = Int8Linear(nn.Linear(224, 77))  # int8-a8 rounds blocks of 32 inputs
    return [("f32_matmul", f32_matmul, 200, lambda b: (linear.weight, linear.bias if b else None)),
            ("int8_matmul", int8_matmul, 200, lambda b: (int8.weight, int8.scales, int8.bias if b else None)),
            ("int4_matmul", int4_matmul, 192,
             lambda b: (int4.codes, int4.scales, int4.zeros, 64, int4.bias if b else None)),
            ("int4_a8_matmul", int4_a8_matmul, 192,
             lambda b: (int4.codes, int4.scales, int4.zeros, 64, int4.bias if b else None)),
            ("int8_a8_matmul", int8_a8_matmul, 224,
             lambda b: (int8_224.weight, int8_224.scales, int8_224.bias if b else None))]


@pytest.mark.parametrize("name,python,k,rest", cases())
def test_each_cpp_operator_equals_its_python_function_bit_for_bit(loaded, name, python, k, rest, monkeypatch):
    op = getattr(torch.ops.blockformer_c, name)
    for shape in ((1, k), (3, 1, k), (6, k), (2, 2, k)):  # rows in blocks of 4 and past, any leading dims
        for bias in (True, False):
            x = torch.randn(shape)
            expected = python(x, *rest(bias))
            assert torch.equal(op(x, *rest(bias)), expected)
            assert torch.equal(op(x.transpose(0, -1).contiguous().transpose(0, -1), *rest(bias)), expected)  # strided
            assert op(x, *rest(bias)).shape == (*shape[:-1], expected.shape[-1])


def test_a_wrong_input_is_refused_with_its_expectation(loaded):
    int8 = Int8Linear(nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match=r"int8_matmul: x must be fp32, got BFloat16"):
        torch.ops.blockformer_c.int8_matmul(torch.randn(1, 64, dtype=torch.bfloat16), int8.weight, int8.scales)
    with pytest.raises(RuntimeError, match=r"int8_matmul: the weight must be a contiguous \(out, 48\) tensor"):
        torch.ops.blockformer_c.int8_matmul(torch.randn(1, 48), int8.weight, int8.scales)
    odd = Int8Linear(nn.Linear(40, 32))
    with pytest.raises(RuntimeError, match=r"int8_a8_matmul: the inputs \(40\) must be a multiple of 32"):
        torch.ops.blockformer_c.int8_a8_matmul(torch.randn(1, 40), odd.weight, odd.scales)


def profiled_ops(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("blockformer")}


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-a8", "int8-a8"])
def test_preparing_a_model_for_decoding_loads_them_and_eager_and_compiled_steps_call_them(scheme, monkeypatch):
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=2, n_heads=4, init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    monkeypatch.setattr(native, "CPP_OPS", False)
    native.load_cpp_ops.cache_clear()
    prepare_for_decoding(model, "fp32", scheme)
    assert native.CPP_OPS  # loaded by the preparation
    prompt = [[5, 9, 2, 7, 11]]
    eager = generate(model, prompt, 6, temperature=0)
    op = f"blockformer_c::{scheme.replace('-', '_')}_matmul"
    attention = "blockformer_c::decode_attention"  # each step after the prompt's (nn/decode_attention.py)
    assert profiled_ops(lambda: generate(model, prompt, 6, temperature=0)) == {op, attention}
    layer = next(m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear)))
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(1, 1, layer.in_features)
    with torch.inference_mode():
        expected = layer(x)
        assert torch.equal(compiled(x), expected)
        assert profiled_ops(lambda: compiled(x)) == {op}
    monkeypatch.setattr(native, "CPP_OPS", False)  # the Python operators give the same tokens
    assert generate(model, prompt, 6, temperature=0) == eager


@pytest.mark.parametrize("make", ["int8", "int4", "int4-a8", "int8-a8", "streamed", "packed"])
def test_quantizing_or_streaming_loads_them_and_packing_alone_does_not(make, monkeypatch):
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=1, n_heads=4)
    model = build_model(cfg, seed=0).eval()
    monkeypatch.setattr(native, "CPP_OPS", False)
    monkeypatch.setattr(kernels, "streams_decode_matmuls", lambda dtype: make == "streamed")
    native.load_cpp_ops.cache_clear()
    if make in ("int8", "int4", "int4-a8", "int8-a8"):
        quantize(model, make)  # as `blockformer eval --quantize` and bench_decode do, without prepare_for_decoding
    else:
        pack_linears(model, compiled=True)
    assert any(isinstance(m, StreamedLinear) for m in model.modules()) == (make == "streamed")
    assert native.CPP_OPS == (make != "packed")


def test_where_they_cannot_be_built_a_warning_and_the_python_operators_decode_the_same(monkeypatch):
    layer = Int8Linear(nn.Linear(64, 32))
    x = torch.randn(1, 1, 64)
    expected = x @ layer.dequantized(torch.float32).T + layer.bias
    real = native._built

    def no_cxx(source, filename, flags, libs=("-lm",), cxx=False):
        if cxx:
            raise RuntimeError("c++ failed: no such compiler")
        return real(source, filename, flags, libs, cxx)

    monkeypatch.setattr(native, "_built", no_cxx)
    monkeypatch.setattr(native, "CPP_OPS", False)
    native.load_cpp_ops.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"C\+\+ operators were not built \(c\+\+ failed: no such compiler\)"):
            assert native.load_cpp_ops() is False
        assert native.CPP_OPS is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: asking again is answered from the cache, silently
            assert native.load_cpp_ops() is False
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    finally:
        native.load_cpp_ops.cache_clear()  # the next caller loads them again (or finds them loaded)
