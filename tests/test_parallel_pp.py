"""Pipeline parallelism: each schedule reproduces the one-process run of the decoder."""

from __future__ import annotations

import pytest

from blockformer.config import TransformerConfig
from blockformer.errors import UsageError
from blockformer.models import build_model
from blockformer.parallel.pipeline import check_pp, stage_bounds

from parallel_helpers import run_ranks
from test_parallel_dp import _train_on_rank, assert_same_run, reference

UNTIED = ("model.tie_embeddings=false", "model.n_layers=4")


def test_stage_bounds_balance_blocks():
    assert stage_bounds(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]


def test_pp_refuses_what_it_does_not_build():
    with pytest.raises(UsageError, match="pipeline stages are built for the decoder only"):
        check_pp(TransformerConfig(arch="encoder-decoder", d_model=16, n_heads=2, n_layers=2), 2, "1f1b")
    with pytest.raises(UsageError, match="tie_embeddings=false"):
        check_pp(TransformerConfig(d_model=16, n_heads=2, n_layers=2), 2, "1f1b")
    with pytest.raises(UsageError, match="needs 4 stages"):
        check_pp(TransformerConfig(d_model=16, n_heads=2, n_layers=3, tie_embeddings=False), 2,
                 "interleaved-1f1b")


def _schedules(rank: int, tmp: str, schedules: list[str]) -> None:
    for schedule in schedules:
        _train_on_rank(rank, "lm", tmp, [*UNTIED, "parallel.pp=2", f"parallel.pp_schedule={schedule}"], schedule)


@pytest.mark.parametrize("schedules", [["1f1b"], pytest.param(["gpipe", "interleaved-1f1b"], marks=pytest.mark.slow)])
def test_pipeline_schedules_match_one_process(tmp_path, schedules):
    ref = reference("lm", tmp_path, *UNTIED)
    run_ranks(2, _schedules, str(tmp_path), schedules)
    for schedule in schedules:
        assert_same_run(tmp_path, schedule, ref)


def _composed(rank: int, tmp: str, layouts) -> None:
    for out, overrides in layouts:
        _train_on_rank(rank, "lm", tmp, [*UNTIED, *overrides], out)


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [
    (4, [("pp_fsdp", ["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_microbatches=2"])]),
    (8, [("pp_fsdp_tp", ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp_microbatches=2",
                         "parallel.pp_schedule=interleaved-1f1b"])]),
])
def test_pipeline_composes_with_fsdp_and_tp(tmp_path, world, layouts):
    ref = reference("lm", tmp_path, *UNTIED)
    run_ranks(world, _composed, str(tmp_path), layouts)
    for out, _ in layouts:
        assert_same_run(tmp_path, out, ref)
