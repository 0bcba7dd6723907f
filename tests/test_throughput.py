"""Measured matmul peak, cached per machine, and the MFU the trainer reports against it."""

import json

import pytest
import torch

from blockformer.cli import main
from blockformer.stats import flops_per_token
from blockformer.train import train
from blockformer.train import throughput
from blockformer.train.checkpoint import resolve_checkpoint
from blockformer.train.load import read_config
from blockformer.train.throughput import (format_flops, machine_key, measure_bandwidth, measure_peak,
                                           memory_bandwidth, peak_flops, utilisation)

from test_train_loop import QUIET, tiny_lm


def test_measured_fp32_peak_is_a_plausible_rate():
    peak = measure_peak(torch.device("cpu"), torch.float32, budget_s=0.02, repeats=1)
    assert 1e8 < peak < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s on any CPU


def test_measuring_the_peak_leaves_the_global_random_state_alone():
    state = torch.get_rng_state()
    measure_peak(torch.device("cpu"), torch.float32, budget_s=0.0, repeats=1)
    assert torch.equal(torch.get_rng_state(), state)  # else a run would train differently on a cold cache


def test_peak_is_cached_per_machine_and_precision_and_refreshed_on_request(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(throughput, "measure_peak", lambda device, dtype: calls.append(dtype) or 1e9 * len(calls))
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "fp32", cache_dir=tmp_path) == 1e9
    assert peak_flops(cpu, "fp32", cache_dir=tmp_path) == 1e9  # cached: not measured again
    assert peak_flops(cpu, "bf16", cache_dir=tmp_path) == 2e9
    assert peak_flops(cpu, "fp32", cache_dir=tmp_path, refresh=True) == 3e9
    assert calls == [torch.float32, torch.bfloat16, torch.float32]
    table = json.loads((tmp_path / "peak.json").read_text())
    assert table == {f"{machine_key(cpu)}|fp32": 3e9, f"{machine_key(cpu)}|bf16": 2e9}
    (tmp_path / "peak.json").write_text("not json")  # a damaged cache is measured over
    assert peak_flops(cpu, "fp32", cache_dir=tmp_path) == 4e9


def test_a_cached_peak_below_the_one_thread_peak_is_measured_again_and_not_kept_low(tmp_path, monkeypatch):
    """A peak measured while another process held a core (38 GFLOP/s at 2 threads against
    101 at 1, as a shared machine cached it) made MFU read 250%: it is measured again, and a
    figure still below the one-thread peak is used but not cached."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    key = f"{machine_key(cpu)}|fp32"
    one = key.replace("|threads=2|", "|threads=1|")
    (tmp_path / "peak.json").write_text(json.dumps({key: 38e9, one: 101e9}))
    measured = iter([60e9, 190e9])
    monkeypatch.setattr(throughput, "measure_peak", lambda device, dtype: next(measured))
    assert peak_flops(cpu, "fp32", cache_dir=tmp_path) == 60e9  # still contended: used, not cached
    assert json.loads((tmp_path / "peak.json").read_text())[key] == 38e9
    assert peak_flops(cpu, "fp32", cache_dir=tmp_path) == 190e9  # quiet: cached
    assert json.loads((tmp_path / "peak.json").read_text())[key] == 190e9
    assert peak_flops(cpu, "fp32", cache_dir=tmp_path) == 190e9  # and read back, not measured (iterator spent)


def test_utilisation_is_model_flops_over_the_peak():
    assert utilisation(6e6, 1000, 2.0, 1e10) == {"flops_per_s": 3e9, "mfu": pytest.approx(0.3)}
    assert utilisation(6e6, 1000, 2.0, None) == {"flops_per_s": 3e9}
    assert format_flops(1.234e12) == "1.23 TFLOP/s" and format_flops(5e8) == "500 MFLOP/s"


def test_trainer_logs_flops_and_mfu_against_the_cached_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKFORMER_CACHE", str(tmp_path / "home-cache"))
    monkeypatch.setattr(throughput, "measure_peak", lambda device, dtype: 2.5e10)
    cfg = tiny_lm(tmp_path, "train.steps=6", "train.log_every=2", "train.eval_every=0", "train.precision=fp32")
    lines = []
    train(cfg, tmp_path / "run", log=lines.append)
    assert any("fp32 matmul peak 25 GFLOP/s" in line for line in lines)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if r["split"] == "train"]
    assert len(rows) == 3
    saved = read_config(resolve_checkpoint(tmp_path / "run"))  # vocab_size set by the tokenizer
    fpt = flops_per_token(saved.model, 32)
    for r in rows:  # language modelling: every token read is a target
        assert r["flops_per_s"] == pytest.approx(fpt * r["tokens_per_s"], rel=1e-6)
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / 2.5e10, rel=1e-9)
    assert json.loads((tmp_path / "home-cache" / "peak.json").read_text())  # cached for the next run


def test_measured_bandwidth_is_the_bytes_a_sum_reads_over_its_time(monkeypatch):
    real = measure_bandwidth(torch.device("cpu"), mib=64, repeats=2)
    assert 1e8 < real < 1e13  # between 0.1 GB/s and 10 TB/s on any CPU
    clock = iter(range(100))  # perf_counter ticks one second per call: each timed sum takes 1 s
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: float(next(clock)))
    assert measure_bandwidth(torch.device("cpu"), mib=8, repeats=1) == 8 * 2**20  # 8 MiB read in 1 s


def test_bandwidth_is_cached_beside_the_peaks_and_refreshed_on_request(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(throughput, "measure_bandwidth", lambda device: calls.append(device) or 1e10 * len(calls))
    cpu = torch.device("cpu")
    assert memory_bandwidth(cpu, cache_dir=tmp_path) == 1e10
    assert memory_bandwidth(cpu, cache_dir=tmp_path) == 1e10  # cached
    assert memory_bandwidth(cpu, cache_dir=tmp_path, refresh=True) == 2e10
    assert json.loads((tmp_path / "peak.json").read_text()) == {f"{machine_key(cpu)}|read": 2e10}


def test_info_peak_measures_fp32_and_bf16_and_the_bandwidth(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BLOCKFORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(throughput, "measure_peak", lambda device, dtype: 4e10 if dtype == torch.float32 else 8e10)
    monkeypatch.setattr(throughput, "measure_bandwidth", lambda device: 1.42e10)
    assert main(["info", "--peak", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "peak fp32    40 GFLOP/s" in out and "peak bf16    80 GFLOP/s" in out
    assert "bandwidth    14.2 GB/s  (streaming read of 512 MiB" in out
    assert main(["info", "--peak", "--device", "cpu", "--json"]) == 0
    peaks = json.loads(capsys.readouterr().out)
    assert peaks["peak_flops"] == {"fp32": 4e10, "bf16": 8e10} and peaks["read_bytes_per_s"] == 1.42e10
    assert main(["info"]) == 2  # nothing to describe
