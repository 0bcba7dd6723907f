"""Int8 weight-only quantization for decoding: error bounds, and the same greedy tokens."""

import importlib
import platform

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from blockformer import TransformerConfig, build_model, native
from native_builds import kernels_built_for
from blockformer.generate import generate
from blockformer.kernels import NATIVE_QUANTIZED_ROWS
from blockformer.generate.quantize import (KERNEL_MAX_ROWS, Int4A8Linear, Int4Linear, Int8A8Linear, Int8Linear,
                                           dequantize_int4, prepare_for_decoding, quantize, round_activations)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_error_is_within_half_a_step_per_weight(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() == 127
    x = torch.randn(5, 64)
    exact = linear(x)
    # Each weight is off by at most half a quantization step, scales[n] / 2.
    bound = x.abs().sum(-1, keepdim=True) * q.scales.float()[None] / 2
    assert ((q(x) - exact).abs() <= bound + 1e-5).all()
    assert (q(x) - exact).abs().max() > 0  # it really is quantized
    out = q(x.to(dtype)).float()
    assert ((out - exact).abs() <= bound + 0.05 * exact.abs() + 0.05).all()


def test_quantized_decoder_reads_int8_weights_and_keeps_every_clear_greedy_choice():
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=2, n_heads=4, init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))
    float_logits = model(tokens)
    quantize(model, "int8")
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, out, up, down per block, and the head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.embed.tokens.weight.dtype == torch.float32  # embeddings stay float
    q_logits = model(tokens)
    error = (q_logits - float_logits).abs().max()
    relative_rms = (q_logits - float_logits).pow(2).mean().sqrt() / float_logits.pow(2).mean().sqrt()
    assert error > 0 and relative_rms < 0.03
    # Wherever the float model's top choice leads by more than twice the largest logit
    # error, the int8 model makes the same choice; that is most positions here.
    top2 = float_logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * error
    assert clear.float().mean() > 0.5
    assert torch.equal(q_logits.argmax(-1)[clear], float_logits.argmax(-1)[clear])
    # And it decodes through the KV cache like any model.
    assert len(generate(model, [[5, 9, 2, 7]], 12, temperature=0)[0]) == 12


def test_int4_linear_rounds_each_weight_within_half_a_step_of_its_group():
    torch.manual_seed(0)
    linear = nn.Linear(256, 50)  # 50 outputs: the kernel's layout pads them to 64
    q = Int4Linear(linear, group_size=64)
    assert q.group_size == 64 and q.codes.dtype == torch.uint8 and q.codes.shape == (50, 128)
    w = linear.weight.detach()
    step = q.scales.repeat_interleave(64, dim=1)  # (50, 256): each weight's group scale
    err = (q.dequantized(torch.float32) - w).abs()
    assert (err <= step / 2 + 1e-6).all() and err.max() > 0
    x = torch.randn(5, 256)  # 5 rows: the dense path, exactly x @ dequantized^T
    torch.testing.assert_close(q(x), x @ q.dequantized(torch.float32).T + linear.bias, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear])
def test_bf16_products_agree_on_torchs_packed_kernel_the_c_kernel_and_the_dense_path(layer):
    # A decode step (<= KERNEL_MAX_ROWS rows in bf16) goes through PyTorch's packed kernel (or
    # the C kernel), a few more rows through the C kernel, a long batch through the dequantized
    # weight; all compute the same product.
    torch.manual_seed(0)
    q = layer(nn.Linear(128, 96).to(torch.bfloat16))
    x = torch.randn(NATIVE_QUANTIZED_ROWS + 1, 128, dtype=torch.bfloat16)
    dense = q(x).float()
    batch = q(x[: KERNEL_MAX_ROWS + 4]).float()  # the C kernel
    rows = torch.cat([q(x[i : i + 2]) for i in range(0, KERNEL_MAX_ROWS + 4, 2)]).float()  # 2 rows at a time
    exact = x.float() @ q.dequantized(torch.float32).T + q.bias.float()
    for y, e in ((dense, exact), (batch, exact[: KERNEL_MAX_ROWS + 4]), (rows, exact[: KERNEL_MAX_ROWS + 4])):
        assert (y - e).abs().max() < 0.02 * e.abs().max()


QUANTIZE = importlib.import_module("blockformer.generate.quantize")  # the package exports the function


def count_kernel_calls(monkeypatch) -> list[tuple[int, int]]:
    """(output channels, threads) of each call into the int8 and int4 C kernels from now on."""
    calls = []
    for name in ("_int8_matmul", "_int4_matmul", "_int4_a8_matmul", "_int8_a8_matmul"):
        real = getattr(QUANTIZE, name)()
        monkeypatch.setattr(QUANTIZE, name, lambda real=real: lambda *a: calls.append(a[-2:]) or real(*a))
    monkeypatch.setattr(native, "CPP_OPS", False)  # the Python operators, which call the counted functions
    return calls


ROWS = [1, 2, 3, 4, 7, 9, 17, NATIVE_QUANTIZED_ROWS + 1]  # 5 (or 6, 8) and more: the repacked paths and panels


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layer,tol", [(lambda: Int8Linear(nn.Linear(200, 77)), 1e-5),  # widths no vector divides
                                       (lambda: Int8Linear(nn.Linear(208, 40)), 1e-5),  # 1 row: 32s, then a 16
                                       (lambda: Int4Linear(nn.Linear(192, 50), group_size=64), 1e-4)])  # 3 groups
def test_decode_rows_in_fp32_go_through_the_c_kernels_and_equal_the_dequantized_product(layer, tol, threads,
                                                                                         monkeypatch):
    assert QUANTIZE._int8_matmul() is not None and QUANTIZE._int4_matmul() is not None  # cc is part of the set-up
    calls = count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    q = layer()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ROWS:  # 1 to 4 rows, then blocks of 4 and a remainder, then panels of 16 channels
            x = torch.randn(rows, q.in_features)
            exact = x @ q.dequantized(torch.float32).T + q.bias
            torch.testing.assert_close(q(x), exact, atol=tol, rtol=tol)
            torch.testing.assert_close(q(x.T.contiguous().T), exact, atol=tol, rtol=tol)  # a strided input
            torch.testing.assert_close(q(x[:, None]), exact[:, None], atol=tol, rtol=tol)  # (batch, 1, k), as decoding
    finally:
        torch.set_num_threads(before)
    # every call took the C kernel, on each thread, however many rows: fp32 rows have no dense path
    assert calls == [(q.out_features, threads)] * 3 * len(ROWS)


@pytest.mark.parametrize("in_c", [True, False])
@pytest.mark.parametrize("layer,bits", [(lambda: Int8Linear(nn.Linear(200, 77).to(torch.bfloat16)), 8),
                                        (lambda: Int4Linear(nn.Linear(192, 50).to(torch.bfloat16), group_size=64), 4)])
def test_bf16_int8_decode_rows_take_the_c_kernel_in_fp32_on_a_cpu_without_amx(layer, bits, in_c, monkeypatch):
    # There torch's bf16 int8 kernel was the slower (BENCHMARKS.md); its int4 one was not, and AMX CPUs, not
    # measured, keep torch's. Either way the product is the dequantized one, rounded to bf16.
    monkeypatch.setattr(QUANTIZE.kernels, "INT8_BF16_IN_C", in_c)
    calls = count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    q = layer()
    for rows in (1, 3, 6, 64, NATIVE_QUANTIZED_ROWS + 1):
        x = torch.randn(rows, q.in_features, dtype=torch.bfloat16)
        y = q(x)
        exact = x.float() @ q.dequantized(torch.float32).T + q.bias.float()
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), exact, atol=0.02, rtol=0.01)  # a bf16 rounding of the output
    # up to KERNEL_MAX_ROWS torch's kernel where measured the faster, past it the C kernel (not the dense
    # path, which dequantizes every weight each call), past BF16_INT8_NATIVE_ROWS (int8: 64 rows) or
    # NATIVE_QUANTIZED_ROWS (int4) a dense bf16 matmul
    assert len(calls) == ((3 if in_c else 1) if bits == 8 else 2)  # int8: 1, 3, 6 rows, or 6; int4: 6 and 64


@pytest.mark.parametrize("cap,flags", [("default", []), ("avx2", ["-mavx2", "-mfma", "-mf16c"])])  # plain C; intrinsics
def test_each_build_of_the_c_kernels_equals_the_dequantized_product(cap, flags, monkeypatch):
    """The kernels as built for a CPU without AVX2 (the plain C bodies) and for one with it: each
    reads the int4 codes in pack_int4's order and the int8 weights row by row."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the instruction-set flags are x86's")
    builds = (native.load, QUANTIZE._int8_matmul, QUANTIZE._int4_matmul, QUANTIZE._int4_a8_matmul,
              QUANTIZE._int8_a8_matmul)
    torch.manual_seed(0)
    int8, int4 = Int8Linear(nn.Linear(200, 77)), Int4Linear(nn.Linear(192, 50), group_size=64)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    for build in builds:
        build.cache_clear()
    try:
        assert native.arch_flags() == flags
        for rows, biased in ((1, False), (3, True), (6, True), (13, False)):  # a block of rows, a partial one,
            # past four; 6 and 13 take int8-a8's repacked path, 13 int4-a8's (tiles of 4 rows, 8 channels a group)
            b8, b4 = (int8.bias, int4.bias) if biased else (None, None)  # the kernels add it, or nothing
            x = torch.randn(rows, 200)
            torch.testing.assert_close(QUANTIZE.int8_matmul(x, int8.weight, int8.scales, b8),
                                       F.linear(x, int8.dequantized(torch.float32), b8), atol=1e-5, rtol=1e-5)
            w160 = int8.weight[:, :160].contiguous()  # int8-a8: whole blocks of 32 inputs
            torch.testing.assert_close(QUANTIZE.int8_a8_matmul(x[:, :160], w160, int8.scales, b8),
                                       F.linear(round_activations(x[:, :160]), w160 * int8.scales[:, None], b8),
                                       atol=1e-5, rtol=1e-5)
            x = torch.randn(rows, 192)
            torch.testing.assert_close(QUANTIZE.int4_matmul(x, int4.codes, int4.scales, int4.zeros, 64, b4),
                                       F.linear(x, int4.dequantized(torch.float32), b4), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(QUANTIZE.int4_a8_matmul(x, int4.codes, int4.scales, int4.zeros, 64, b4),
                                       F.linear(round_activations(x), int4.dequantized(torch.float32), b4),
                                       atol=1e-5, rtol=1e-5)  # integer sums: exact up to the float ones' order
            small = Int4Linear(nn.Linear(96, 40), group_size=32)  # groups of one block: not paired
            torch.testing.assert_close(QUANTIZE.int4_a8_matmul(x[:, :96], small.codes, small.scales, small.zeros, 32),
                                       F.linear(round_activations(x[:, :96]), small.dequantized(torch.float32)),
                                       atol=1e-5, rtol=1e-5)
        assert None not in (QUANTIZE._int8_matmul(), QUANTIZE._int4_matmul(), QUANTIZE._int4_a8_matmul(),
                            QUANTIZE._int8_a8_matmul())  # built
    finally:
        monkeypatch.undo()
        for build in builds:  # the next test builds for this machine again
            build.cache_clear()


def test_round_activations_gives_each_block_of_32_its_own_255_levels():
    torch.manual_seed(0)
    x = torch.randn(3, 96) * torch.tensor([1.0, 100.0, 0.01]).repeat_interleave(32)  # blocks of very different scale
    x[1, 32:64] = 0  # a block of zeros stays zeros
    r = round_activations(x)
    step = x.reshape(3, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert (r.reshape(3, 3, 32) - x.reshape(3, 3, 32)).abs().le(step / 2 + 1e-6 * step).all()  # within half a step
    levels = r.reshape(3, 3, 32) / step.clamp(min=1e-30)
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)  # whole steps of each block's own size
    assert levels.abs().amax(-1).flatten().tolist() == pytest.approx([127.0] * 4 + [0.0] + [127.0] * 4)
    assert not torch.equal(r, x)
    assert round_activations(x.to(torch.bfloat16)).dtype == torch.bfloat16


A8_LAYERS = {  # an a8 layer and its weight-only twin (the same weights), for in_features k and groups g
    "int4-a8": lambda linear, g: (Int4A8Linear(linear, group_size=g), Int4Linear(linear, group_size=g)),
    "int8-a8": lambda linear, g: (Int8A8Linear(linear), Int8Linear(linear)),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("scheme,k,group", [("int4-a8", 192, 64), ("int4-a8", 96, 32), ("int4-a8", 256, 128),
                                            ("int8-a8", 96, None), ("int8-a8", 800, None)])  # paired runs; single
def test_a8_rows_equal_the_rounded_activations_times_the_dequantized_weight_on_every_path(scheme, k, group, threads,
                                                                                          monkeypatch):
    """The kernel's integer sums, the dense path past the kernel's rows and torch's fallback all
    compute round_activations(x) @ W.T + b; and that differs from the weight-only product by
    the activations' rounding alone (it is applied, and small)."""
    calls = count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    q, weight_only = A8_LAYERS[scheme](nn.Linear(k, 50), group)
    assert not hasattr(q, "packed")  # only the codes a8 reads: no second copy for torch's int4 kernel
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ROWS:
            x = torch.randn(rows, k)
            exact = F.linear(round_activations(x), q.dequantized(torch.float32), q.bias)
            y = q(x)
            torch.testing.assert_close(y, exact, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(q(x[:, None]), exact[:, None], atol=1e-5, rtol=1e-5)
            w = weight_only(x)
            gap = (y - w).abs().max() / w.abs().max()
            assert 1e-5 < gap < 0.02, gap
    finally:
        torch.set_num_threads(before)
    # 2 a8 calls and 1 weight-only at every row count
    assert calls == [(50, threads)] * 3 * len(ROWS)
    for rows in (3, 9):  # the few-row bodies; the repacked path
        x = torch.randn(rows, k)
        x[1, 40], x[2, 70] = float("inf"), float("nan")
        y = q(x)  # as in the dense product: those rows NaN, the others untouched; no garbage, no crash
        assert y[1:3].isnan().all() and y[[0, *range(3, rows)]].isfinite().all()
    monkeypatch.setattr(QUANTIZE, f"_{scheme.replace('-', '_')}_matmul", lambda: None)  # not built: torch, the same
    x = torch.randn(2, k)
    torch.testing.assert_close(q(x), F.linear(round_activations(x), q.dequantized(torch.float32), q.bias),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("in_c", [True, False])  # whether bf16 rows take C kernels (False: an AMX CPU)
@pytest.mark.parametrize("scheme", ["int4-a8", "int8-a8"])
def test_bf16_rows_of_an_a8_layer_take_its_c_kernel_up_to_its_limit(scheme, in_c, monkeypatch):
    """Torch has no kernel for the a8 schemes, and the dense path dequantizes the whole weight
    each call: so bf16 rows, as a server's many in-flight sequences bring, widen to fp32 for the
    a8 kernel, any number of them as fp32 rows; on an AMX CPU (not measured) past
    NATIVE_QUANTIZED_ROWS they take the dense path."""
    monkeypatch.setattr(QUANTIZE.kernels, "INT8_BF16_IN_C", in_c)
    calls = count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    q, _ = A8_LAYERS[scheme](nn.Linear(192, 50).to(torch.bfloat16), 64)
    for rows in (1, 6, 64, NATIVE_QUANTIZED_ROWS + 1):
        x = torch.randn(rows, 192, dtype=torch.bfloat16)
        y = q(x)
        exact = F.linear(round_activations(x.float()), q.dequantized(torch.float32), q.bias.float())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), exact, atol=0.02, rtol=0.01)  # a bf16 rounding of the output
    assert calls == [(50, native.pieces(50))] * (4 if in_c else 3)  # 1, 6, 64 rows; 129 where no AMX


@pytest.mark.parametrize("cap", [None, "avx2"])  # the build for this CPU (VNNI where it has it); maddubs's 16 bits
def test_int8_a8_products_at_full_scale_do_not_saturate(cap, monkeypatch):
    """Every weight and input at +-127 steps: each pair of byte products sums to 2 x 127 x 127,
    just inside AVX2's 16-bit maddubs, and a block of 32 to 516,128 in 32 bits."""
    with kernels_built_for(cap, monkeypatch, QUANTIZE._int8_a8_matmul):
        linear = nn.Linear(64, 8, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.tensor([1.0, -1.0]).repeat(8, 32) * torch.arange(1, 9)[:, None])
        q = Int8A8Linear(linear)
        assert q.weight.abs().min() == 127
        x = torch.tensor([[3.0] * 32 + [-3.0] * 32, [-2.0, 2.0] * 32])  # each block at its own max
        for rows in (x, x.repeat(5, 1) * torch.tensor([1.0, -1.0]).repeat(5)[:, None]):  # and 10: the repacked path
            torch.testing.assert_close(QUANTIZE.int8_a8_matmul(rows, q.weight, q.scales), rows @ linear.weight.T,
                                       atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cap", [None, "avx2"])
def test_int4_a8_products_at_full_scale_do_not_overflow(cap, monkeypatch):
    """Codes at 15 (and 0) against inputs at +-127 steps: without VNNI the many-row path adds a
    block's 8 maddubs as int16, at most 16 x 15 x 127 = 30,480 a lane, before widening."""
    with kernels_built_for(cap, monkeypatch, QUANTIZE._int4_a8_matmul):
        q = torch.tensor([15, 0]).repeat_interleave(8)[:, None].expand(16, 128).to(torch.uint8)  # 8 channels each
        codes, scales, zeros = QUANTIZE.pack_int4(q), torch.full((16, 2), 0.01), torch.zeros(16, 2)
        dense = dequantize_int4(codes, scales, zeros, 64, torch.float32)
        x = torch.tensor([[3.0] * 128, [-2.0] * 128])  # each block at its own max, one sign
        for rows in (x, x.repeat(5, 1)):  # 2 rows; 10, the many-row path
            torch.testing.assert_close(QUANTIZE.int4_a8_matmul(rows, codes, scales, zeros, 64), rows @ dense.T,
                                       atol=1e-4, rtol=1e-5)


def test_int8_a8_needs_whole_blocks_of_32_inputs():
    with pytest.raises(ValueError, match="int8-a8: in_features=200 is not a multiple of 32"):
        Int8A8Linear(nn.Linear(200, 16))
    model = build_model(TransformerConfig(arch="decoder", vocab_size=50, d_model=48, n_layers=1, n_heads=4))
    with pytest.raises(ValueError, match="int8-a8: in_features=48"):
        quantize(model, "int8-a8")


def test_int4_codes_hold_inputs_j_and_8_plus_j_of_each_run_of_16_in_one_byte():
    q = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)  # codes 0..15, twice
    codes = QUANTIZE.pack_int4(q)
    assert codes.tolist() == [[j | (8 + j) << 4 for j in range(8)] * 2]
    assert torch.equal(QUANTIZE.unpack_int4(codes), q)


def test_a_compiled_step_calls_the_c_kernels_as_custom_ops_and_equals_the_dequantized_product(monkeypatch):
    calls = count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    layers = nn.Sequential(Int8Linear(nn.Linear(96, 64)), nn.GELU(), Int4Linear(nn.Linear(64, 40), group_size=32))
    compiled = torch.compile(layers, fullgraph=True)  # fullgraph: the ops trace without a graph break
    x = torch.randn(2, 96)
    hidden = torch.nn.functional.gelu(x @ layers[0].dequantized(torch.float32).T + layers[0].bias)
    exact = hidden @ layers[2].dequantized(torch.float32).T + layers[2].bias
    torch.testing.assert_close(compiled(x), exact, atol=1e-4, rtol=1e-4)
    assert [n for n, _ in calls] == [64, 40]  # both products ran in the C kernels, not torch's int8/int4 ops


def test_int4_group_size_falls_back_to_one_that_divides_the_row():
    assert Int4Linear(nn.Linear(96, 16), group_size=128).group_size == 32
    with pytest.raises(ValueError, match="in_features=48 is not a multiple of 32"):
        Int4Linear(nn.Linear(48, 16))
    with pytest.raises(ValueError, match="group_size=100: expected one of"):
        Int4Linear(nn.Linear(128, 16), group_size=100)


def test_int4_decoder_keeps_the_clear_greedy_choices_and_decodes_in_bf16():
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=2, n_heads=4, init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))
    float_logits = model(tokens)
    prompt = [[5, 9, 2, 7, 11]]
    prepare_for_decoding(model, "bf16", "int4")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 2 * 4 + 1
    assert model.embed.tokens.weight.dtype == torch.bfloat16
    q_logits = model(tokens).float()
    error = (q_logits - float_logits).abs().max()
    relative_rms = (q_logits - float_logits).pow(2).mean().sqrt() / float_logits.pow(2).mean().sqrt()
    assert 0.05 < relative_rms < 0.3  # 0.22 here: 16 levels per group of 64 are coarser than int8
    top2 = float_logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * error
    assert torch.equal(q_logits.argmax(-1)[clear], float_logits.argmax(-1)[clear])
    # Cached batch-1 decode steps take the packed kernel; recomputing the whole sequence
    # (5+ rows a step) takes the dense path; both choose the same tokens.
    assert generate(model, prompt, 12, temperature=0) == generate(model, prompt, 12, temperature=0, use_cache=False)


def test_prepare_for_decoding_checks_its_arguments():
    model = build_model(TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=1, n_heads=4))
    with pytest.raises(ValueError, match="precision='int8'"):
        prepare_for_decoding(model, "int8")
    with pytest.raises(ValueError, match="quantize scheme='int2'"):
        prepare_for_decoding(model, "fp32", "int2")
    assert prepare_for_decoding(model, "fp32") is model and model.head.weight.dtype == torch.float32


@pytest.mark.slow
def test_a_compiled_bf16_int8_step_takes_the_c_kernel_and_decodes_as_eager(monkeypatch):
    monkeypatch.setattr(QUANTIZE.kernels, "INT8_BF16_IN_C", True)  # a CPU without AMX, as measured
    torch.compiler.reset()
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=2, n_heads=4, init_std=0.1)
    model = prepare_for_decoding(build_model(cfg, seed=0).eval(), "bf16", "int8")
    calls = count_kernel_calls(monkeypatch)
    prompts = [[5, 9, 2, 7], [1, 2, 3, 4]]
    eager = generate(model, prompts, 8, temperature=0)
    assert len(calls) == 8 * (2 * 4 + 1)  # the prompt and 7 steps, each through every quantized layer
    assert generate(model, prompts, 8, temperature=0, compile=True) == eager
    assert len(calls) - 8 * (2 * 4 + 1) >= 7 * (2 * 4 + 1), len(calls)  # the compiled steps called the kernel too
