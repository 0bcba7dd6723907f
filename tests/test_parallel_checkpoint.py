"""Sharded checkpoints: written at one world size and layout, resumed at another, the run
continues as if uninterrupted; the consolidated weights load on one process."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from blockformer.cli import main as cli
from blockformer.errors import UsageError
from blockformer.parallel import dcp_reader
from blockformer.parallel.checkpoint import DCP_DIR, dcp_weights
from blockformer.train import loop
from blockformer.train.load import load_checkpoint, read_config
from blockformer.train.loop import train

from parallel_helpers import read_json, run_ranks, write_json
from test_parallel_dp import assert_same_run, lm_config, reference

QUIET = {"log": lambda *a: None}


def _resume_on_rank(rank: int, tmp: str, jobs) -> None:
    tmp = Path(tmp)
    for out, overrides, stop_at, resume in jobs:
        cfg = lm_config(tmp, "train.steps=4", *overrides)
        result = train(cfg, tmp / out, stop_at=stop_at, resume=tmp / out if resume else None, **QUIET)
        if rank == 0:
            write_json(tmp / f"{out}-{'resumed' if resume else 'first'}.json", result.losses)


def test_checkpoints_move_between_one_and_two_processes(tmp_path):
    ref = reference("lm", tmp_path, "train.steps=4")
    # one process writes a checkpoint at step 2; two tensor-parallel ranks resume it
    first = train(lm_config(tmp_path, "train.steps=4"), tmp_path / "one", stop_at=2, **QUIET)
    torch.testing.assert_close(torch.tensor(first.losses), torch.tensor(ref[:2]), rtol=1e-5, atol=0)
    run_ranks(2, _resume_on_rank, str(tmp_path), [
        ("one", ["parallel.tp=2"], None, True),
        ("two", ["parallel.dp_shard=2"], 2, False),  # two FSDP ranks write one at step 2 ...
        ("same", ["parallel.dp_shard=2"], 2, False),  # and resume another on the same layout
        ("same", ["parallel.dp_shard=2"], None, True),
    ])
    assert_same_run(tmp_path, "same", ref[2:], read_json(tmp_path / "same-resumed.json"), step=4)
    assert_same_run(tmp_path, "one", ref[2:], read_json(tmp_path / "one-resumed.json"), step=4)
    ckpt = tmp_path / "two" / "step-000002"
    assert (ckpt / DCP_DIR / ".metadata").is_file() and not list((tmp_path / "two").glob(".step-*"))
    # ... which one process resumes
    resumed = train(lm_config(tmp_path, "train.steps=4"), tmp_path / "two", resume=tmp_path / "two", **QUIET)
    assert_same_run(tmp_path, "two", ref[2:], resumed.losses, step=4)


@pytest.mark.slow
def test_four_ranks_resume_on_two_with_another_layout_and_back(tmp_path):
    ref = reference("lm", tmp_path, "train.steps=4")
    run_ranks(4, _resume_on_rank, str(tmp_path), [("four", ["parallel.tp=2"], 2, False)])  # FSDP x TP
    run_ranks(2, _resume_on_rank, str(tmp_path), [("four", ["parallel.dp_replicate=2"], None, True)])
    torch.testing.assert_close(torch.tensor(read_json(tmp_path / "four-first.json")), torch.tensor(ref[:2]),
                               rtol=1e-5, atol=0)
    assert_same_run(tmp_path, "four", ref[2:], read_json(tmp_path / "four-resumed.json"), step=4)
    # and back: two tensor-parallel ranks write, four FSDP x TP ranks (2-D shards) read their pieces
    run_ranks(2, _resume_on_rank, str(tmp_path), [("two", ["parallel.tp=2"], 2, False)])
    run_ranks(4, _resume_on_rank, str(tmp_path), [("two", ["parallel.tp=2", "parallel.dp_shard=2"], None, True)])
    assert_same_run(tmp_path, "two", ref[2:], read_json(tmp_path / "two-resumed.json"), step=4)


def test_consolidated_weights_give_the_same_logits_on_one_process(tmp_path):
    """model.safetensors of a 2-rank tensor-parallel run, in the model's own row order."""
    run_ranks(2, _resume_on_rank, str(tmp_path), [("tp", ["parallel.tp=2", "train.steps=2"], None, False)])
    ckpt = load_checkpoint(tmp_path / "tp" / "step-000002")
    plain = train(lm_config(tmp_path, "train.steps=2"), tmp_path / "ref", **QUIET)
    ref = load_checkpoint(plain.checkpoint)
    tokens = torch.randint(1, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ckpt.model(tokens), ref.model(tokens), rtol=1e-4, atol=1e-5)


def _resume_reading_own_shards(rank: int, tmp: str) -> None:
    """A tensor-parallel run saves dcp/ only; FSDP ranks resume it, counting what each reads."""
    tmp = Path(tmp)
    train(lm_config(tmp, "train.steps=4", "parallel.tp=2", "train.consolidate=false"), tmp / "run", stop_at=2, **QUIET)
    reads = []  # elements per DCP read: the resume's, then rank 0's streamed consolidation at step 4
    reader_read = dcp_reader._SafeReader.read_data

    def counting(self, plan, planner):
        reads.append(sum(math.prod(item.lengths) for item in plan.items if item.type.name == "TENSOR"))
        return reader_read(self, plan, planner)

    def whole(*args, **kwargs):
        raise AssertionError("a rank loaded the whole weights")

    dcp_reader._SafeReader.read_data = counting
    loop.load_weights = whole
    result = train(lm_config(tmp, "train.steps=4", "parallel.dp_shard=2"), tmp / "run", resume=tmp / "run", **QUIET)
    write_json(tmp / f"read-{rank}.json", reads)
    if rank == 0:
        write_json(tmp / "run-resumed.json", result.losses)


def test_a_sharded_checkpoint_resumes_into_another_layout_each_rank_reading_its_shards(tmp_path):
    ref = reference("lm", tmp_path, "train.steps=4")
    run_ranks(2, _resume_reading_own_shards, str(tmp_path))
    ckpt = tmp_path / "run" / "step-000002"
    assert (ckpt / DCP_DIR / ".metadata").is_file() and not (ckpt / "model.safetensors").exists()  # consolidate=false
    # each rank read its half of the weights and AdamW moments (plus the replicated norms), never the whole
    cfg = read_config(ckpt)
    model = load_checkpoint(ckpt).model  # one process reads dcp/ alone
    total = 3 * sum(p.numel() for p in model.parameters())  # weights + exp_avg + exp_avg_sq
    largest = max(p.numel() for p in model.parameters())
    for rank in (0, 1):
        resume, *consolidation = read_json(tmp_path / f"read-{rank}.json")
        assert 0.45 * total < resume < 0.55 * total, (rank, resume, total)
        assert len(consolidation) == (len(dcp_weights(ckpt, cfg)) if rank == 0 else 0)  # a tensor at a time
        assert max(consolidation, default=0) == (largest if rank == 0 else 0)
    # the losses of an uninterrupted run
    assert_same_run(tmp_path, "run", ref[2:], read_json(tmp_path / "run-resumed.json"), step=4)
    # `convert --consolidate` writes model.safetensors from dcp/: the weights a one-process run reaches
    edited = tmp_path / "edited"  # a config.json claiming far more than dcp/ holds is refused before building
    shutil.copytree(ckpt, edited)
    config = json.loads((edited / "config.json").read_text())
    config["model"]["n_layers"] = 10**6
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="describes a model of .* parameters but .*dcp holds"):
        read_config(edited)
    assert cli(["convert", "--consolidate", str(ckpt)]) == 0
    written = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    held = model.state_dict()
    assert written.keys() == dcp_weights(ckpt, cfg).keys() and len(written) >= len(dict(model.named_parameters()))
    ref_weights = safetensors.torch.load_file(str(tmp_path / "ref" / "step-000004" / "model.safetensors"))
    assert written.keys() == ref_weights.keys()  # the names save_model writes, a tied table once
    for name, tensor in written.items():
        assert torch.equal(tensor, held[name]), name
    assert cli(["convert", "--consolidate", str(ckpt)]) == 2  # already there: one line, the file kept


def test_convert_consolidate_refuses_in_one_line(tmp_path, capsys):
    one = train(lm_config(tmp_path, "train.steps=1"), tmp_path / "one", **QUIET).checkpoint
    for argv, words in ((["--consolidate", str(one)], "has no dcp/"),  # a one-process checkpoint: nothing to do
                        (["--consolidate", str(one), "--out", str(tmp_path / "x")], "--out: not with --consolidate"),
                        (["--consolidate", str(tmp_path / "none")], "none")):
        capsys.readouterr()
        assert cli(["convert", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
