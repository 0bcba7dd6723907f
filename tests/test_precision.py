"""precision = "auto": bf16 only where the device has bf16 units, and a warning for emulated bf16."""

import warnings

import pytest
import torch

from blockformer.run_config import load_run_config, preset_names
from blockformer import precision as P
from blockformer.train import train


@pytest.fixture(autouse=True)
def uncapped(monkeypatch):
    """These tests set the CPU probes by hand: the AVX2 cap of `make test-avx2` would hide them
    (tests/test_hardware.py tests the cap itself)."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)

CPU = torch.device("cpu")


def _cpu(monkeypatch, *, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected", [(True, False, "bf16"), (False, True, "bf16"), (True, True, "bf16"), (False, False, "fp32")]
)
def test_auto_picks_bf16_only_on_cpus_with_bf16_units(monkeypatch, avx512_bf16, amx, expected):
    _cpu(monkeypatch, avx512_bf16=avx512_bf16, amx=amx)
    assert P.resolve_precision("auto", CPU) == expected
    assert P.describe_precision("auto", expected, CPU).startswith(f"{expected} (auto: ")
    assert P.resolve_precision("fp32", CPU) == "fp32"  # an explicit choice is kept


def test_explicit_bf16_without_bf16_units_warns_once_with_the_measured_slowdown(monkeypatch):
    _cpu(monkeypatch, avx512_bf16=False, amx=False)
    P._warn_emulated_bf16.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert P.resolve_precision("bf16", CPU) == "bf16"
        assert P.resolve_precision("bf16", CPU) == "bf16"
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert "emulated" in messages[0] and "x the time of fp32" in messages[0]
    ratio = float(messages[0].split("measured ")[1].split("x")[0])
    assert ratio > 0
    P._warn_emulated_bf16.cache_clear()


def test_native_bf16_reads_the_cpu_probes(monkeypatch):
    _cpu(monkeypatch, avx512_bf16=False, amx=False)
    assert not P.native_bf16(CPU)
    _cpu(monkeypatch, avx512_bf16=True, amx=False)
    assert P.native_bf16(CPU) and "AVX512-BF16" in P.cpu_features()


def test_every_preset_defaults_to_auto():
    for name in preset_names():
        assert load_run_config(preset=name).train.precision == "auto", name


def test_training_states_the_precision_auto_chose_and_keeps_auto_in_the_saved_config(monkeypatch, tmp_path):
    _cpu(monkeypatch, avx512_bf16=False, amx=False)
    lines = []
    cfg = load_run_config(preset="copy", overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.progress=false",
        "data.task_max_len=6", "data.heldout=50", "train.eval_samples=20", "train.batch_size=16", "train.steps=2",
    ])
    train(cfg, tmp_path / "run", log=lines.append)
    assert any("in fp32 (auto: no native bf16 on this CPU" in line for line in lines), lines
    assert 'precision = "auto"' in (tmp_path / "run" / "config.toml").read_text()


def test_cast_skips_the_call_only_where_the_dtype_already_matches():
    x = torch.randn(3, 4)
    assert P.cast(x, torch.float32) is x
    y = P.cast(x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x.to(torch.bfloat16))
