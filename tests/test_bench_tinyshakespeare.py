"""benchmarks/bench_tinyshakespeare.py: the plain loop's windows take turns with the trainer's in one
process, and running them changes nothing in what the trainer computes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_tinyshakespeare as bench  # noqa: E402

TEXT = "".join(f"{w} the quick brown fox jumps over the lazy dog {w}.\n" for w in range(400))


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text(TEXT)
    return path


def test_the_plain_windows_leave_the_trainers_losses_as_they_were(text, tmp_path):
    alone = bench.blockformer_run(text, 40, "fp32", tmp_path / "alone")
    turns = bench.blockformer_run(text, 40, "fp32", tmp_path / "turns", reference_steps=20)
    assert alone["reference_windows"] == 0 and turns["reference_windows"] == 2  # after steps 20 and 40
    assert turns["full_val_loss"] == alone["full_val_loss"]
    assert turns["val_loss"] == alone["val_loss"]
    assert turns["reference_tokens_per_s"] > 0
    low, mid, high = turns["paired_ratio_quartiles"]
    assert 0 < low <= mid <= high


def test_the_trainers_windows_leave_the_plain_loops_time_out(text, tmp_path, monkeypatch):
    """A plain window that takes a second more must not lower the trainer's tokens/s."""
    window = bench.Reference.window

    def slow(self, steps):
        rate = window(self, steps)
        bench.time.sleep(1.0)
        return rate

    monkeypatch.setattr(bench.Reference, "window", slow)
    run = bench.blockformer_run(text, 40, "fp32", tmp_path / "slow", reference_steps=40)
    assert run["reference_windows"] == 4
    # 12 x 64 tokens a step, 10 steps a window: a second left in would cap a window at 7,680 tokens/s
    assert run["tokens_per_s"] > 7680


def test_the_report_gives_the_ratio_and_its_quartiles(text, tmp_path):
    out = tmp_path / "ts"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_tinyshakespeare.py"), "--data", str(text),
                    "--steps", "40", "--reference-steps", "20", "--precisions", "fp32", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    row, = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["reference_windows"] == 2
    assert row["ratio_vs_reference"] == pytest.approx(row["tokens_per_s"] / row["reference_tokens_per_s"])
    assert row["ratio_vs_fp32_eager_reference"] == pytest.approx(row["ratio_vs_reference"])
    assert f"({row['reference_windows']}) | {row['ratio_vs_reference']:.2f} |" in out.with_suffix(".md").read_text()
