"""Tensor parallelism: sharded logits equal the full model's; training matches one process;
checkpoints written at one layout resume at another with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockformer.config import TransformerConfig
from blockformer.errors import UsageError
from blockformer.models import build_model
from blockformer.parallel.tensor import check_tp, rank_major_order

from parallel_helpers import read_json, run_ranks, write_json
from test_parallel_dp import _train_on_rank, assert_same_run, reference


def test_rank_major_order_gives_each_rank_whole_parts():
    # q has 4 rows, k and v 2 each: rank 0 takes q0 q1 k0 v0, rank 1 q2 q3 k1 v1
    assert rank_major_order([4, 2, 2], 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


def test_tp_needs_whole_heads_per_rank():
    with pytest.raises(UsageError, match=r"model.n_kv_heads=1: expected a multiple of parallel.tp=2"):
        check_tp(TransformerConfig(n_heads=4, n_kv_heads=1), 2)
    with pytest.raises(UsageError, match="model.position='alibi'"):
        check_tp(TransformerConfig(position="alibi"), 2)


def _logits_on_rank(rank: int, tmp: str) -> None:
    from blockformer.parallel.mesh import Degrees, init_mesh  # noqa: PLC0415
    from blockformer.parallel.tensor import apply_tp  # noqa: PLC0415

    mesh = init_mesh(Degrees(1, 1, 1, 2), torch.device("cpu"))
    out = {}
    for arch in ("decoder", "encoder-decoder"):
        model = build_model(_cfg(arch), seed=0).eval()
        apply_tp(model, mesh["tp"], 2)
        src, tgt = _tokens()
        with torch.no_grad():
            logits = model(src) if arch == "decoder" else model(src, tgt, src_mask=src > 0, tgt_mask=tgt > 0)
        out[arch] = logits.tolist()
    if rank == 0:
        write_json(Path(tmp) / "logits.json", out)


def _cfg(arch: str) -> TransformerConfig:
    return TransformerConfig(arch=arch, vocab_size=30, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn="swiglu", max_seq_len=16)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(1, 30, (2, 7), generator=g)
    src[1, 5:] = 0  # padding
    return src, torch.randint(1, 30, (2, 5), generator=g)


def test_tp_logits_equal_the_full_model(tmp_path):
    run_ranks(2, _logits_on_rank, str(tmp_path))
    got = read_json(tmp_path / "logits.json")
    for arch in ("decoder", "encoder-decoder"):
        model = build_model(_cfg(arch), seed=0).eval()
        src, tgt = _tokens()
        with torch.no_grad():
            ref = model(src) if arch == "decoder" else model(src, tgt, src_mask=src > 0, tgt_mask=tgt > 0)
        torch.testing.assert_close(torch.tensor(got[arch]), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm", "copy"])
def test_tp_fsdp_x_tp_and_hsdp_training_match_one_process(tmp_path, kind):
    ref = reference(kind, tmp_path)
    world = 2 if kind == "copy" else 4
    layouts = [("tp", ["parallel.tp=2"])] + ([("fsdp_tp", ["parallel.tp=2", "parallel.dp_shard=2"]),
                                              ("hsdp", ["parallel.dp_replicate=2", "parallel.dp_shard=2"])]
                                             if world == 4 else [])
    run_ranks(world, _layouts, kind, str(tmp_path), layouts)
    for out, _ in layouts:
        assert_same_run(tmp_path, out, ref)


def _layouts(rank: int, kind: str, tmp: str, layouts) -> None:
    for out, overrides in layouts:
        _train_on_rank(rank, kind, tmp, overrides, out)


def _embedding_grad(tmp: str, overrides: list[str]) -> list | None:
    """The token table's gradient (whole) after one batch's loss, the model built as the loop builds it."""
    from test_parallel_comm import _setup  # noqa: PLC0415

    _, runtime, model, fwd, objective, _ = _setup(tmp, ["model.tie_embeddings=false", *overrides])
    with runtime.loss_context(0.0):
        objective.loss(fwd, objective.next_batch()).backward()
    grad = model.embed.tokens.weight.grad
    return None if grad is None else (grad.full_tensor() if runtime.parallel else grad).tolist()


def _embedding_grads_on_rank(rank: int, tmp: str) -> None:
    out = {mode: _embedding_grad(tmp, ["parallel.tp=2", f"train.compile={mode == 'compiled'}"])
           for mode in ("eager", "compiled")}
    if rank == 0:
        write_json(Path(tmp) / "grads.json", out)


@pytest.mark.slow
def test_tp_compiled_blocks_pass_the_embedding_its_gradient(tmp_path):
    # The table's output reaches the first (compiled) block as an AsyncCollectiveTensor; unwrapped
    # there, it lost its autograd edge and the untied table got no gradient.
    run_ranks(2, _embedding_grads_on_rank, str(tmp_path))
    got = read_json(tmp_path / "grads.json")
    ref = torch.tensor(_embedding_grad(str(tmp_path), []))
    assert got["compiled"] is not None, "no gradient reached the embedding table under compile + TP"
    torch.testing.assert_close(torch.tensor(got["compiled"]), torch.tensor(got["eager"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["eager"]), ref, rtol=1e-5, atol=1e-5)
