"""benchmarks/bench_step_overhead.py runs on a small shape and reports numbers that add up."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_step_splits_into_its_linears_and_the_rest(tmp_path):
    out = tmp_path / "overhead.md"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step_overhead.py"), "--layers", "2",
                    "--d-model", "64", "--heads", "2", "--vocab", "64", "--tokens", "4", "--rounds", "1",
                    "--threads", "1", "--schemes", "fp32", "int4", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    rows = [line for line in out.read_text().splitlines() if re.match(r"\| (fp32|int4) ", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["fp32 (9 linears)", "int4 (9 linears)"]  # 2 blocks x 4, the head
    for row in rows:
        step, alone, rest = (float(c) for c in row.split("|")[2:5])
        assert step > 0 and alone > 0
        assert rest == pytest.approx(step - alone, abs=0.011)  # each figure is rounded to 0.01


def test_bad_counts_exit_2():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step_overhead.py"), "--tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tokens and --rounds: expected at least 1" in done.stderr
