"""The launch a user types: torchrun runs `blockformer train` on 2 processes; one process evaluates it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from blockformer.cli import main
from blockformer.parallel.checkpoint import DCP_DIR

from parallel_helpers import free_port


@pytest.mark.slow
def test_torchrun_trains_on_two_processes_and_eval_reads_it_on_one(tmp_path, capsys):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--master-port={free_port()}", "-m", "blockformer", "train", "--preset", "copy",
           "--set", "parallel.dp_shard=2", "--set", "model.d_model=32", "--set", "model.n_layers=1",
           "--set", "model.d_ff=64", "--set", "train.steps=4", "--set", "train.eval_every=0",
           "--set", "train.batch_size=8", "--set", "train.eval_samples=8", "--set", "data.heldout=20",
           "--set", "train.progress=false", "--out", str(run_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("parallel: 2 processes: dp_shard 2") == 1  # rank 0 logs, alone
    assert proc.stdout.count("held-out examples") == 1  # and reports once
    ckpts = sorted(run_dir.glob("step-*"))
    assert [p.name for p in ckpts] == ["step-000004"]
    assert (ckpts[0] / "model.safetensors").is_file() and (ckpts[0] / DCP_DIR / ".metadata").is_file()
    assert main(["eval", "--checkpoint", str(run_dir), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert 0 < metrics["val_loss"] < 3.0  # below log(14) = 2.64 + margin: a trained copy model, read whole


def test_a_parallel_section_needs_a_matching_world(tmp_path, capsys):
    code = main(["train", "--preset", "copy", "--set", "parallel.tp=2", "--set", "train.steps=1",
                 "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "parallel: dp_replicate=1 x tp=2 x pp=1 = 2 does not divide the world size 1" in err
    assert "torchrun --nproc_per_node=N" in err


def test_task_heads_and_lora_are_refused_in_parallel():
    from blockformer.parallel import start  # noqa: PLC0415
    from blockformer.errors import UsageError  # noqa: PLC0415
    from blockformer.run_config import load_run_config  # noqa: PLC0415

    for extra in ("head.task=classify", "lora.rank=4"):
        with pytest.raises(UsageError, match="task heads and LoRA adapters train on one process"):
            start(load_run_config(overrides=["parallel.tp=2", extra]), torch.device("cpu"))
