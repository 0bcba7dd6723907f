"""The hardware-dependent kernel choices (``blockformer/kernels.py``) on concrete inputs, the
call sites that follow them, and the ``ATEN_CPU_CAPABILITY=avx2`` cap they obey."""

import pytest
import torch
from torch import nn

from blockformer import hardware, kernels
from blockformer import precision as P
from blockformer.nn import attention as attention_module
from blockformer.nn import dropout as dropout_module
from blockformer.nn import loss as loss_module

CPU, META = torch.device("cpu"), torch.device("meta")  # meta: a device that is not the CPU
BF16, FP32 = torch.bfloat16, torch.float32
PROBES = {"avx512": "_is_avx512_supported", "avx512_bf16": "_is_avx512_bf16_supported",
          "amx": "_is_amx_tile_supported"}


def _cpu(monkeypatch, **features: bool) -> None:
    """Make ``kernels`` see a CPU with exactly ``features`` (e.g. ``avx512_bf16=True``)."""
    have = {PROBES[name] for name, on in features.items() if on}
    monkeypatch.setattr(kernels, "cpu_has", lambda probe: probe in have)


def _attention_cpu(monkeypatch, **features: bool) -> None:
    """As ``_cpu``, and the import-time attention choice re-probed on that CPU."""
    _cpu(monkeypatch, **features)
    monkeypatch.setattr(kernels, "UNFUSED_SHORT_BF16", kernels.avx512_bf16_units())


# --- attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("features, kind", [
    ({"avx512": True, "avx512_bf16": True}, True),
    ({"avx512": True, "avx512_bf16": True, "amx": True}, True),  # AMX: measured too (bench_attention_choice)
    ({"avx512": True, "amx": True}, False),  # AMX without AVX512-BF16: not measured
    ({"avx512": True}, False),  # bf16 emulated: not measured
    ({}, False),
])
def test_the_short_key_choice_is_for_avx512_bf16_cpus(monkeypatch, features, kind):
    _attention_cpu(monkeypatch, **features)
    assert kernels.avx512_bf16_units() is kind
    assert kernels.unfused_attention(CPU, BF16, 64, 0.0, True) is kind


def test_the_constants_are_this_cpu_probed_at_import():
    assert kernels.UNFUSED_SHORT_BF16 == kernels.avx512_bf16_units()
    assert kernels.INT8_BF16_IN_C == kernels.bf16_rows_in_c_kernels()
    assert kernels.CPU_BF16_UNFUSED_MAX_KEYS == 128


@pytest.mark.parametrize("device, dtype, keys, dropout, grad, unfused", [
    (CPU, BF16, 64, 0.0, True, True),  # bf16 training over short keys
    (CPU, BF16, 128, 0.0, True, True),  # the last key count measured faster unfused
    (CPU, BF16, 129, 0.0, True, False),
    (CPU, BF16, 256, 0.0, True, False),  # longer keys: fused
    (CPU, FP32, 64, 0.0, True, False),  # fp32: fused at every length
    (CPU, BF16, 64, 0.0, False, False),  # inference: fused
    (META, BF16, 64, 0.0, True, False),  # not a CPU
    (CPU, FP32, 4096, 0.1, True, True),  # dropout on a CPU: always written out
    (CPU, BF16, 4096, 0.1, True, True),
    (CPU, FP32, 64, 0.1, False, False),  # no grad: no dropout path
    (META, FP32, 64, 0.1, True, False),
])
def test_unfused_attention_on_avx512_bf16(monkeypatch, device, dtype, keys, dropout, grad, unfused):
    _attention_cpu(monkeypatch, avx512=True, avx512_bf16=True)
    assert kernels.unfused_attention(device, dtype, keys, dropout, grad) is unfused


def test_without_the_measured_cpu_kind_only_dropout_is_unfused(monkeypatch):
    _attention_cpu(monkeypatch, avx512=True)  # bf16 emulated: not measured
    assert not kernels.unfused_attention(CPU, BF16, 64, 0.0, True)
    assert kernels.unfused_attention(CPU, BF16, 64, 0.1, True)


@pytest.mark.parametrize("unfused", [True, False])
def test_sdpa_follows_the_choice_at_call_time(monkeypatch, unfused):
    calls, seen = [], []
    real = attention_module._unfused
    monkeypatch.setattr(attention_module, "_unfused", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kernels, "unfused_attention", lambda *a: seen.append(a) or unfused)
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    out = attention_module.sdpa(q, k, v, None, True, 0.0)
    assert len(calls) == int(unfused)
    assert seen == [(CPU, FP32, 5, 0.0, True)]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# --- the head fused with the loss --------------------------------------------------------


def test_the_head_is_fused_from_fuse_min_vocab_classes(monkeypatch):
    h = torch.randn(2, 3, 8)
    assert kernels.FUSE_MIN_VOCAB == 1000 and kernels.HEAD_LOSS_CHUNK_ROWS == 128
    assert kernels.fuse_head_loss(nn.Linear(8, 1000), h)
    assert not kernels.fuse_head_loss(nn.Linear(8, 999), h)
    monkeypatch.setattr(kernels, "FUSE_MIN_VOCAB", 10)  # read when the choice is made
    assert kernels.fuse_head_loss(nn.Linear(8, 10), h)
    assert not kernels.fuse_head_loss(nn.Linear(8, 9), h)


def test_the_head_is_not_fused_for_a_subclass_or_a_traced_graph(monkeypatch):
    class Adapted(nn.Linear):  # as LoRA's linear is
        pass

    h = torch.randn(4, 8)
    assert not kernels.fuse_head_loss(Adapted(8, 2000), h)
    assert not kernels.fuse_head_loss(nn.Sequential(nn.Linear(8, 2000)), h)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not kernels.fuse_head_loss(nn.Linear(8, 2000), h)


def test_head_loss_follows_the_choice_and_the_chunk_rows_at_call_time(monkeypatch):
    torch.manual_seed(0)
    head, h, targets = nn.Linear(8, 30), torch.randn(20, 8), torch.randint(1, 30, (20,))
    with torch.no_grad():
        expected = float(loss_module.token_loss(head(h), targets))
    applied = []
    real_apply = loss_module._LinearCrossEntropy.apply
    monkeypatch.setattr(loss_module._LinearCrossEntropy, "apply", lambda *a: applied.append(1) or real_apply(*a))
    with torch.no_grad():
        assert float(loss_module.head_loss(h, head, targets)) == pytest.approx(expected, rel=1e-5)
    assert applied == []  # 30 classes < FUSE_MIN_VOCAB: one piece

    monkeypatch.setattr(kernels, "FUSE_MIN_VOCAB", 0)
    monkeypatch.setattr(kernels, "HEAD_LOSS_CHUNK_ROWS", 7)
    linears = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: linears.append(1) or real_linear(*a))
    with torch.no_grad():
        assert float(loss_module.head_loss(h, head, targets)) == pytest.approx(expected, rel=1e-5)
    assert applied == [1] and len(linears) == 3  # 20 rows, 7 at a time


# --- dropout -----------------------------------------------------------------------------


def test_the_cheap_mask_is_for_plain_cpu_tensors_in_eager_mode(monkeypatch):
    class Sharded(torch.Tensor):  # stands for a DTensor: any tensor subclass keeps F.dropout
        pass

    assert kernels.cheap_dropout(torch.randn(4))
    assert not kernels.cheap_dropout(torch.randn(4).as_subclass(Sharded))
    assert not kernels.cheap_dropout(torch.empty(4, device="meta"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not kernels.cheap_dropout(torch.randn(4))


@pytest.mark.parametrize("cheap", [True, False])
def test_dropout_follows_the_choice(monkeypatch, cheap):
    masks = []
    real = dropout_module.keep_mask
    monkeypatch.setattr(dropout_module, "keep_mask", lambda *a: masks.append(1) or real(*a))
    monkeypatch.setattr(kernels, "cheap_dropout", lambda x: cheap)
    y = dropout_module.dropout(torch.ones(1000), 0.5)
    assert len(masks) == int(cheap)
    assert set(y.unique().tolist()) <= {0.0, 2.0}
    dropout_module.dropout(torch.ones(10), 1.0)  # p = 1 is F.dropout's whatever the choice
    assert len(masks) == int(cheap)


# --- packing and precision ---------------------------------------------------------------


@pytest.mark.parametrize("features, bf16, fp32", [
    ({"avx512": True, "avx512_bf16": True}, True, True),
    ({"avx512": True, "amx": True}, True, False),  # fp32 packed was slower than F.linear on AMX
    ({"amx": True}, True, False),
    ({"avx512": True}, False, True),
    ({}, False, False),  # AVX2 alone: not measured, F.linear
])
def test_which_dtypes_pack_on_which_cpu(monkeypatch, features, bf16, fp32):
    _cpu(monkeypatch, **features)
    assert kernels.packs_on_this_cpu(BF16) is bf16
    assert kernels.packs_on_this_cpu(FP32) is fp32
    assert kernels.packs_on_this_cpu(torch.float16) is False


@pytest.mark.parametrize("features, streams", [
    ({}, True),  # AVX2 alone: the C kernel, twice torch.mm's pace there
    ({"avx512": True, "avx512_bf16": True}, True),  # packed when eager; a compiled step streams (1.8x F.linear)
    ({"avx512": True}, True),
    ({"avx512": True, "amx": True}, False),  # neither: F.linear streamed faster than both
])
def test_which_cpus_stream_fp32_decode_matmuls_through_the_c_kernel(monkeypatch, features, streams):
    _cpu(monkeypatch, **features)
    assert kernels.streams_decode_matmuls(FP32) is streams
    assert kernels.streams_decode_matmuls(BF16) is False


@pytest.mark.parametrize("features, bf16", [
    ({}, True),  # AVX2 alone: torch's bf16 kernels emulate bf16
    ({"avx512": True, "avx512_bf16": True}, True),  # measured: int8 1.2-1.5x torch's bf16 kernel
    ({"avx512": True, "avx512_bf16": True, "amx": True}, False),  # not measured: torch's
])
def test_which_cpus_take_the_c_kernels_for_quantized_products(monkeypatch, features, bf16):
    _cpu(monkeypatch, **features)
    monkeypatch.setattr(kernels, "INT8_BF16_IN_C", kernels.bf16_rows_in_c_kernels())  # as at import
    for bits in (8, 4):
        assert kernels.native_quantized_matmul(FP32, 1, bits)
        assert kernels.native_quantized_matmul(FP32, 4096, bits)  # the panels beat the dense path at any count
        assert not kernels.native_quantized_matmul(torch.float16, 1, bits)
    assert kernels.native_quantized_matmul(BF16, 4, 8) is bf16
    assert not kernels.native_quantized_matmul(BF16, 4, 4)  # torch's bf16 int4 kernel was the faster
    for bits, limit in ((8, kernels.BF16_INT8_NATIVE_ROWS), (4, kernels.NATIVE_QUANTIZED_ROWS)):
        # past torch's few rows: the C kernel, not a dense path that dequantizes every weight; past the
        # limit a dense bf16 matmul was the faster
        assert kernels.native_quantized_matmul(BF16, kernels.TORCH_PACKED_MAX_ROWS + 1, bits)
        assert kernels.native_quantized_matmul(BF16, limit, bits)
        assert not kernels.native_quantized_matmul(BF16, limit + 1, bits)
    assert kernels.BF16_INT8_NATIVE_ROWS < kernels.NATIVE_QUANTIZED_ROWS  # int8 hands over sooner


def test_can_pack_follows_the_choice(monkeypatch):
    from blockformer.generate import packed  # noqa: PLC0415

    monkeypatch.setattr(kernels, "packs_on_this_cpu", lambda dtype: False)
    packed.can_pack.cache_clear()
    try:
        assert not packed.can_pack(FP32) and not packed.can_pack(BF16)
    finally:
        packed.can_pack.cache_clear()


@pytest.mark.parametrize("features, native", [
    ({"avx512": True, "avx512_bf16": True}, True),
    ({"amx": True}, True),
    ({"avx512": True}, False),
    ({}, False),
])
def test_native_bf16_on_cpus_with_amx_or_avx512_bf16(monkeypatch, features, native):
    _cpu(monkeypatch, **features)
    assert kernels.native_bf16_cpu() is native
    assert P.native_bf16(CPU) is native
    assert P.resolve_precision("auto", CPU) == ("bf16" if native else "fp32")


# --- the AVX2 cap ------------------------------------------------------------------------


def test_the_avx2_cap_turns_every_cpu_choice_to_the_avx2_one(monkeypatch):
    """A CPU with AVX-512 and AVX512-BF16 (no AMX), as torch's probes report it; then capped."""
    assert kernels.cpu_has is hardware.cpu_has  # the probes go through the cap
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    for probe, on in (("_is_avx512_supported", True), ("_is_avx512_bf16_supported", True),
                      ("_is_amx_tile_supported", False)):
        monkeypatch.setattr(torch.cpu, probe, lambda on=on: on, raising=False)
    choices = lambda: (kernels.avx512_bf16_units(), kernels.packs_on_this_cpu(BF16),  # noqa: E731
                       kernels.packs_on_this_cpu(FP32), kernels.native_bf16_cpu())
    assert choices() == (True, True, True, True)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert choices() == (False, False, False, False)
    assert P.resolve_precision("auto", CPU) == "fp32"


def _cache_dir_after_import(env: dict[str, str]) -> str:
    import os
    import subprocess
    import sys
    code = ("import importlib, os, blockformer; importlib.reload(blockformer); "
            "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR', ''))")
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def test_a_capped_cpu_capability_gets_its_own_inductor_cache(tmp_path):
    # inductor's cache keys graphs without the cap: a shared cache handed an uncapped graph's
    # 16-lane loops to an AVX2 build, and GPT-2's compiled decode step segfaulted
    given = str(tmp_path / "cache")
    assert _cache_dir_after_import({"ATEN_CPU_CAPABILITY": "AVX2", "TORCHINDUCTOR_CACHE_DIR": given}) == given + "-avx2"
    assert _cache_dir_after_import({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": given + "-avx2"}) \
        == given + "-avx2"  # once: a child process inherits the suffixed directory
    assert _cache_dir_after_import({"ATEN_CPU_CAPABILITY": "default"}).endswith("-default")
    assert _cache_dir_after_import({"TORCHINDUCTOR_CACHE_DIR": given}) == given
    assert _cache_dir_after_import({}) == ""  # uncapped: torch's own default, untouched
