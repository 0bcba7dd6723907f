"""``make gpu-check``'s script: its checks pass on the CPU (the same code paths, gloo for NCCL),
and without a GPU the CUDA run says so in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.mark.slow
def test_gpu_check_passes_its_checks_on_the_cpu(tmp_path):
    out = tmp_path / "gpu-check.md"
    result = _run("--device", "cpu", "--quick", "--steps", "40", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = out.read_text(encoding="utf-8")
    assert table.count("| PASS |") == 5 and "FAIL" not in table, table
    assert "gloo" in table and "max relative difference" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: `make gpu-check` runs on it")
def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    result = _run("--out", str(tmp_path / "gpu-check.md"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no CUDA device visible" in result.stderr
    assert not (tmp_path / "gpu-check.md").exists()
