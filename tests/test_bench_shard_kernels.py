"""benchmarks/bench_shard_kernels.py: its written-out attention is the fused one, and it reports a row per kernel;
benchmarks/bench_training_kernels.py reports each setting of the training kernels against torch's."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_shard_kernels import SavedSoftmaxAttention  # noqa: E402


def test_the_attention_that_keeps_its_softmax_gives_the_fused_outputs_and_gradients():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    do = torch.randn(3, 2, 7, 8, dtype=torch.float64)
    got = SavedSoftmaxAttention.apply(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad(got, (q, k, v), do)
    g_want = torch.autograd.grad(want, (q, k, v), do)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_it_reports_each_kernel_in_microseconds(tmp_path):
    out = tmp_path / "shard.md"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_shard_kernels.py"), "--rows", "2", "--tokens", "8",
                    "--ffn", "16", "--repeats", "2", "--out", str(out)], check=True, capture_output=True, text=True,
                   timeout=300)
    text = out.read_text()
    times = [float(m) for m in re.findall(r"\| (\d+) \|$", text, re.M)]
    assert len(times) == 11 and all(t >= 0 for t in times)
    assert float(re.search(r"by at most (\S+)\.", text).group(1)) < 1e-5


def test_a_size_below_one_exits_2():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_shard_kernels.py"), "--rows", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--rows: expected at least 1" in done.stderr


def test_the_training_kernels_benchmark_reports_each_setting_against_torchs(tmp_path):
    out = tmp_path / "kernels.md"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_training_kernels.py"), "--presets", "char-lm-tiny",
                    "--rows", "2", "--windows", "1", "--steps", "1", "--out", str(out)], check=True,
                   capture_output=True, text=True, timeout=300)
    rows = re.findall(r"^\| `char-lm-tiny` \| 2 \| (.+?) \| ([\d.]+) \| ([\d.]+)x \|$", out.read_text(), re.M)
    assert [r[0] for r in rows] == ["torch's attention and GELU", "blockformer's attention", "blockformer's GELU",
                                    "both of blockformer's"]
    assert all(float(ms) > 0 for _, ms, _ in rows) and float(rows[0][2]) == 1.0
    for setting, ms, ratio in rows:  # each ratio is the first setting's time over this one's
        assert abs(float(ratio) - float(rows[0][1]) / float(ms)) < 0.01


def test_the_training_kernels_benchmark_refuses_a_size_below_one():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_training_kernels.py"), "--windows", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--windows: expected at least 1" in done.stderr


def test_the_training_kernels_benchmark_times_the_trainer_itself(tmp_path):
    if not (REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt").is_file():
        pytest.skip("tinyshakespeare is not in ../shared/data")
    out = tmp_path / "trainer.md"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_training_kernels.py"), "--trainer", "--presets",
                    "char-lm-tiny", "--windows", "1", "--steps", "2", "--out", str(out)], check=True,
                   capture_output=True, text=True, timeout=300)
    text = out.read_text()
    assert "of the trainer (rows split over threads)" in text
    rows = re.findall(r"^\| `char-lm-tiny` \| 12 \| (.+?) \| ([\d.]+) \| ([\d.]+)x \|$", text, re.M)
    assert [r[0] for r in rows] == ["torch's attention and GELU", "both of blockformer's"]
    assert all(float(ms) > 0 for _, ms, _ in rows)
