"""benchmarks/bench_kv_cache_dtype.py runs on a small shape and a small checkpoint, and reports a
speed row per weight form and cache dtype and a quality row per cache dtype that fit together."""

import re
import subprocess
import sys
from pathlib import Path

from blockformer import build_model
from blockformer.run_config import load_run_config
from blockformer.tokenizers import train_tokenizer
from blockformer.train.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "benchmarks" / "bench_kv_cache_dtype.py")


def test_speed_and_quality_rows(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    cfg = load_run_config(overrides=["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
                                     "model.vocab_size=260", "model.max_seq_len=32", "model.position=rope",
                                     f"data.text={text}", "data.tokenizer=byte", "data.seq_len=32",
                                     "data.val_fraction=0.2"])
    ckpt = save_checkpoint(tmp_path / "ck", build_model(cfg.model, seed=0).eval(), train_tokenizer("byte", []), cfg)
    out = tmp_path / "kv.md"
    subprocess.run([sys.executable, SCRIPT, "--layers", "2", "--d-model", "64", "--heads", "2", "--vocab", "64",
                    "--prompt", "20", "--tokens", "6", "--rounds", "2", "--threads", "1", "--weights", "streamed",
                    "int4", "--checkpoint", str(ckpt), "--windows", "3", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    table = out.read_text()
    speed = re.findall(r"^\| (streamed|int4) \| (fp32|bf16|fp16|int8) \| ([\d.]+) \| ([\d.]+)x \|", table, re.M)
    assert [(w, kv) for w, kv, *_ in speed] == [(w, kv) for w in ("streamed", "int4")
                                                for kv in ("fp32", "bf16", "fp16", "int8")]
    assert all(float(tps) > 0 for _, _, tps, _ in speed)
    assert [ratio for _, kv, _, ratio in speed if kv == "fp32"] == ["1.000", "1.000"]
    quality = re.findall(r"^\| (fp32|bf16|fp16|int8) \| ([\d.]+) \| ([+-][\d.]+) \| ([\d.e+-]+) \| ([\d.]+)% \|$",
                         table, re.M)
    assert [q[0] for q in quality] == ["fp32", "bf16", "fp16", "int8"] and "96 predictions" in table  # 3 windows of 32
    fp32, bf16, fp16, int8 = quality
    assert fp32[2:] == ("+0.00000", "0.00e+00", "100.00")  # the fp32 cache against itself
    assert 0 < float(fp16[3]) < float(bf16[3]) < 0.5  # fp16 keeps 3 more mantissa bits
    assert 0 < float(int8[3]) < 0.5  # 255 levels a row against bf16's 8 bits of mantissa: near bf16's
    assert float(bf16[4]) > 90 and abs(float(bf16[2])) < 0.01


def test_bad_counts_exit_2():
    done = subprocess.run([sys.executable, SCRIPT, "--tokens", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tokens: at least 2" in done.stderr
