"""CPU detection: the probes, and the cap that ATEN_CPU_CAPABILITY puts on them."""

import pytest
import torch

from blockformer.hardware import BEYOND_AVX2, cpu_has


def test_a_probe_reads_torch_when_uncapped(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    for probe in sorted(BEYOND_AVX2) + ["_is_avx2_supported"]:
        fn = getattr(torch.cpu, probe, None)
        assert cpu_has(probe) == (bool(fn()) if fn is not None else False), probe
    assert cpu_has("_no_such_probe") is False


@pytest.mark.parametrize("cap", ["avx2", "AVX2", "default"])
def test_an_avx2_cap_hides_every_feature_beyond_it(monkeypatch, cap):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    assert not any(cpu_has(p) for p in BEYOND_AVX2)
    fn = getattr(torch.cpu, "_is_avx2_supported", None)
    if fn is not None:  # AVX2 itself is not capped
        assert cpu_has("_is_avx2_supported") == bool(fn())


def test_the_avx2_cap_makes_auto_precision_pick_fp32(monkeypatch):
    from blockformer.precision import resolve_precision

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
