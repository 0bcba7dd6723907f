"""Data parallelism (DDP, FSDP2, HSDP) reproduces the one-process run: same losses, same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from blockformer import kernels
from blockformer.parallel.data import shard_batch
from blockformer.parallel.mesh import Degrees, resolve_degrees
from blockformer.run_config import ParallelConfig, load_run_config
from blockformer.errors import UsageError
from blockformer.train.loop import train

from parallel_helpers import read_json, run_ranks, write_json

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(200))


def lm_config(tmp: Path, *overrides: str):
    text = tmp / "text.txt"
    if not text.exists():
        text.write_text(TEXT, encoding="utf-8")
    return load_run_config(overrides=[
        f"data.text={text}", f"data.cache_dir={tmp / 'cache'}", "data.seq_len=16",
        "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn=swiglu",
        "model.max_seq_len=32", "train.batch_size=4", "train.grad_accum=2", "train.steps=3",
        "train.warmup=1", "train.lr=1e-3", "train.eval_every=0", "train.eval_batches=2",
        "train.progress=false", "train.log_every=1", "model.bias=false", "train.precision=fp32", *overrides,
    ])


# model.bias=false: the key bias's gradient is zero up to rounding (softmax ignores a shift
# of all scores), and Adam turns that rounding noise into lr-sized steps that no two
# summation orders share.
def copy_config(*overrides: str):
    return load_run_config(preset="copy", overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.d_ff=64", "train.batch_size=6",
        "train.steps=3", "train.warmup=1", "train.eval_every=0", "train.eval_batches=1",
        "train.eval_samples=4", "data.heldout=20", "train.progress=false", "train.log_every=1",
        "model.bias=false", "train.precision=fp32", *overrides,
    ])


CONFIGS = {"lm": lm_config, "copy": lambda tmp, *o: copy_config(*o)}


def weights(run_dir: Path, step: int = 3) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(run_dir / f"step-{step:06d}" / "model.safetensors"))


def _train_on_rank(rank: int, kind: str, tmp: str, overrides: list[str], out: str) -> None:
    result = train(CONFIGS[kind](Path(tmp), *overrides), Path(tmp) / out, log=lambda *a: None)
    if rank == 0:
        write_json(Path(tmp) / f"{out}.json", result.losses)


def reference(kind: str, tmp: Path, *overrides: str) -> list[float]:
    return train(CONFIGS[kind](tmp, *overrides), tmp / "ref", log=lambda *a: None).losses


def assert_same_run(tmp: Path, out: str, ref_losses: list[float], losses: list[float] | None = None,
                    step: int = 3) -> None:
    losses = read_json(tmp / f"{out}.json") if losses is None else losses
    assert len(losses) == len(ref_losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    ref, got = weights(tmp / "ref", step), weights(tmp / out, step)
    assert ref.keys() == got.keys()
    for name in ref:  # relative to each tensor's norm: Adam's first steps are +-lr wherever a
        # gradient is near zero, so a single element may move by rounding noise times lr
        assert torch.linalg.norm(got[name] - ref[name]) <= 1e-5 * torch.linalg.norm(ref[name]), name


@pytest.mark.parametrize("kind", ["lm", "copy"])
def test_ddp_and_fsdp_match_one_process(tmp_path, kind):
    ref = reference(kind, tmp_path)
    run_ranks(2, _two_layouts, kind, str(tmp_path))
    for out in ("fsdp", "ddp"):
        assert_same_run(tmp_path, out, ref)


def _two_layouts(rank: int, kind: str, tmp: str, fuse_every_head: bool = False) -> None:
    if fuse_every_head:  # the small test vocabulary would keep the one-piece loss (a fresh process)
        kernels.FUSE_MIN_VOCAB = 0
    _train_on_rank(rank, kind, tmp, ["parallel.dp_shard=2"], "fsdp")
    _train_on_rank(rank, kind, tmp, ["parallel.dp_replicate=2"], "ddp")


def test_the_fused_head_loss_under_ddp_and_fsdp_matches_one_process_without_it(tmp_path):
    """The ranks fuse the (tied) head with the loss (``nn/loss.py``); the reference does not."""
    ref = reference("lm", tmp_path)
    run_ranks(2, _two_layouts, "lm", str(tmp_path), True)
    for out in ("fsdp", "ddp"):
        assert_same_run(tmp_path, out, ref)


def test_degrees_must_multiply_to_the_world_size():
    assert resolve_degrees(ParallelConfig(), 4) == Degrees(pp=1, dp_replicate=1, dp_shard=4, tp=1)
    assert resolve_degrees(ParallelConfig(tp=2), 8).dp_shard == 4
    with pytest.raises(UsageError, match=r"dp_shard=2 x dp_replicate=1 x tp=2 x pp=1 = 4, but the world size is 2"):
        resolve_degrees(ParallelConfig(dp_shard=2, tp=2), 2)
    with pytest.raises(UsageError, match="does not divide the world size 3"):
        resolve_degrees(ParallelConfig(tp=2), 3)


def test_ranks_read_disjoint_slices_that_make_the_global_batch():
    x, y = torch.arange(12).view(6, 2), torch.arange(12).view(6, 2) + 1
    parts = [shard_batch((x, y), r, 4) for r in range(4)]
    assert [len(p[0]) for p in parts] == [1, 2, 1, 2]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), x)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), y)


def _bf16(rank: int, tmp: str) -> None:
    _train_on_rank(rank, "lm", tmp, ["parallel.dp_shard=2", "train.precision=bf16"], "bf16")


@pytest.mark.slow
def test_fsdp_bf16_mixed_precision_tracks_one_process_autocast(tmp_path):
    """FSDP's MixedPrecisionPolicy (bf16 weights in compute, fp32 gradient reduction) against
    bf16 autocast on one process: not bit-equal, within bf16's rounding."""
    ref = reference("lm", tmp_path, "train.precision=bf16")
    run_ranks(2, _bf16, str(tmp_path))
    torch.testing.assert_close(torch.tensor(read_json(tmp_path / "bf16.json")), torch.tensor(ref), rtol=1e-3, atol=0)
