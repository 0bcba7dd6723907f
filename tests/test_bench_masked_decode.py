"""benchmarks/bench_masked_decode.py runs on a small shape and reports, for each case and cache
dtype, SDPA's time and the kernel's, their ratio, and whether both gave the same tokens."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "benchmarks" / "bench_masked_decode.py")


def test_a_row_per_case_and_cache_with_both_times_and_their_ratio(tmp_path):
    out = tmp_path / "masked.md"
    subprocess.run([sys.executable, SCRIPT, "--layers", "2", "--d-model", "64", "--heads", "2", "--vocab", "300",
                    "--prompt", "40", "--tokens", "6", "--rounds", "2", "--threads", "1", "--cases", "padded",
                    "seq2seq", "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    rows = re.findall(r"^\| ([\w ,]+?) \| (fp32|bf16) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| (\d) of 2 \| (yes|no) \|$",
                      out.read_text(), re.M)
    assert [(case, kv) for case, kv, *_ in rows] == [("padded, batch 4", "fp32"), ("padded, batch 4", "bf16"),
                                                     ("seq2seq greedy, 16 sources", "fp32"),
                                                     ("seq2seq beam 4, 16 sources", "fp32")]
    for _, _, off, on, ratio, _, same in rows:  # times of a few ms, printed to 1 ms: the ratio is the unrounded one
        assert float(off) >= 0 and float(on) >= 0 and 0.2 < float(ratio) < 5
        assert same == "yes"  # the kernel's tokens are SDPA's on these shapes
