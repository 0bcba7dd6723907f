"""The parallel planner's figures for the Llama-like 7B preset, checked against hand arithmetic."""

from __future__ import annotations

import json

import pytest

from blockformer import TransformerConfig
from blockformer.cli import main
from blockformer.errors import UsageError
from blockformer.parallel.plan import plan
from blockformer.run_config import load_run_config

P_7B = 6_738_415_616  # Llama 2 7B: 32 x (4 * 4096^2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
NORMS_7B = (2 * 32 + 1) * 4096  # RMSNorm gains: the only parameters tensor parallelism replicates here
GIB = 2**30


def test_fsdp_over_8_ranks_divides_the_7b_state_by_8():
    p = plan(load_run_config(preset="llama-7b"), 8)
    assert p["parameters"] == P_7B
    assert p["parameters_per_rank"] == P_7B / 8
    mem = p["memory_bytes"]
    assert mem["weights"] == mem["gradients"] == 4 * P_7B / 8 and mem["optimizer"] == 8 * P_7B / 8
    s, b, h, V = 4096, 64 / 8, 4096, 32000
    # full checkpointing: each block's bf16 input, one block recomputed, fp32 logits; a block keeps 10 + attention's 8
    # + the gated FFN's 8 * d_ff / h = 21.5 (Korthikanti's 4h GELU: 16) bf16 bytes per s*b*h
    assert mem["activations"] == pytest.approx(2 * s * b * h * 32 + (10 + 8 + 21.5) * s * b * h + 8 * s * b * V)
    comm = p["comm_bytes_per_step"]
    assert comm["fsdp_all_gather"] == pytest.approx(2 * 2 * P_7B * 7 / 8)  # bf16, forward and backward
    assert comm["fsdp_reduce_scatter"] == pytest.approx(4 * P_7B * 7 / 8)  # fp32 gradients


def test_tensor_parallel_splits_all_but_the_norms():
    p = plan(load_run_config(preset="llama-7b", overrides=["parallel.tp=2", "train.activation_checkpointing=none"]), 2)
    assert p["parameters_per_rank"] == (P_7B - NORMS_7B) / 2 + NORMS_7B
    s, b, h, V = 4096, 64, 4096, 32000
    # sequence parallel: of the 10 outside the TP matmuls, the 2 sublayer inputs (4) stay gathered, the rest
    # (6) is split with the 8 + 21.5 inside; loss parallel: the fp32 logits and their gradient split too
    assert p["memory_bytes"]["activations"] == pytest.approx(32 * s * b * h * (4 + 6 / 2 + (8 + 21.5) / 2) + 8 * s * b * V / 2)
    comm, stream = p["comm_bytes_per_step"], b * s * h * 2 * 1 / 2  # one bf16 all-gather of the stream on 2 ranks
    # per sublayer (64) a gather in and a scatter out, forward and backward; the stack's output and input grads
    assert comm["tp_all_gather"] == comm["tp_reduce_scatter"] == pytest.approx((64 * 2 + 2) * stream)
    # the embedding's partial sums, and loss parallel's two (b, s) fp32 all-reduces; no logits gathered
    assert comm["tp_all_reduce"] == pytest.approx(2 * stream + 2 * 2 * b * s * 4 * 1 / 2)
    assert "tp_logits_all_gather" not in comm


def test_the_7b_under_tp_8_plans_what_the_trainer_runs():
    """Sequence and loss parallelism: full checkpointing keeps sequence shards, logits stay
    split. Before, the planner described plain TP: 152 GiB per rank."""
    p = plan(load_run_config(preset="llama-7b", overrides=["parallel.tp=8"]), 8)
    s, b, h, V = 4096, 64, 4096, 32000
    sbh = s * b * h
    assert p["memory_bytes"]["activations"] == pytest.approx(2 * sbh / 8 * 32 + sbh * (4 + 6 / 8 + 29.5 / 8) + 8 * s * b * V / 8)
    assert p["memory_bytes"]["total"] / GIB == pytest.approx(36.80, abs=0.01)
    stream = b * s * h * 2 * 7 / 8
    # full checkpointing: the forward's gather and scatter once more in the backward's recompute
    assert p["comm_bytes_per_step"]["tp_all_gather"] == pytest.approx((64 * 3 + 2) * stream)
    smoothed = plan(load_run_config(preset="llama-7b", overrides=["parallel.tp=8", "train.label_smoothing=0.1"]), 8)
    assert smoothed["comm_bytes_per_step"]["tp_logits_all_gather"] == pytest.approx(b * s * V * 4 * 7 / 8)
    assert smoothed["memory_bytes"]["activations"] - p["memory_bytes"]["activations"] == pytest.approx(
        8 * s * b * V * 7 / 8)


def test_accumulation_reduces_gradients_once_a_step_and_holds_them_unsharded_until_then():
    one = plan(load_run_config(preset="llama-7b"), 8)
    four = plan(load_run_config(preset="llama-7b", overrides=["train.grad_accum=4"]), 8)
    assert four["comm_bytes_per_step"]["fsdp_reduce_scatter"] == one["comm_bytes_per_step"]["fsdp_reduce_scatter"]
    assert four["comm_bytes_per_step"]["fsdp_all_gather"] == 4 * one["comm_bytes_per_step"]["fsdp_all_gather"]
    assert four["memory_bytes"]["gradients"] == 4 * P_7B + 4 * P_7B / 8  # whole fp32 gradients, then the shard
    every = plan(load_run_config(preset="llama-7b", overrides=["train.grad_accum=4", "parallel.grad_sync=every"]), 8)
    assert every["comm_bytes_per_step"]["fsdp_reduce_scatter"] == 4 * one["comm_bytes_per_step"]["fsdp_reduce_scatter"]
    assert every["memory_bytes"]["gradients"] == 4 * P_7B / 8  # sharded all along


def test_pipeline_stages_hold_their_blocks():
    cfg = load_run_config(preset="llama-7b", overrides=["parallel.pp=2"])
    p = plan(cfg, 2)
    block = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert p["parameters_per_rank"] == 16 * block + 32000 * 4096 + 4096  # the last stage: 16 blocks + head + norm


def test_world_size_must_fit_the_mesh():
    with pytest.raises(UsageError, match="does not divide the world size 6"):
        plan(load_run_config(preset="llama-7b", overrides=["parallel.tp=4"]), 6)
    with pytest.raises(UsageError, match="model.n_kv_heads=8: expected a multiple of parallel.tp=16"):
        plan(load_run_config(preset="llama-1b", overrides=["parallel.tp=16"]), 16)


def test_info_prints_the_plan(capsys):
    assert main(["info", "--preset", "llama-7b", "--world-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["parameters_per_rank"] == P_7B / 8
    assert main(["info", "--preset", "llama-7b", "--world-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "mesh         8 ranks: pp 1 x dp_replicate 1 x dp_shard 8 x tp 1" in text
    assert "memory/rank  34.06 GiB: weights 3.14 GiB, gradients 3.14 GiB, AdamW 6.28 GiB" in text


@pytest.mark.parametrize("extra", [
    dict(arch="decoder"),
    dict(arch="encoder-decoder", position="relative", n_encoder_layers=66, n_decoder_layers=67),
    dict(arch="decoder", ffn_experts=4, experts_top_k=2, shared_experts=1),
])
def test_a_deep_plan_counts_what_the_full_build_counts(extra):
    """Past EXACT_LAYERS the plan builds 2 blocks a stack and repeats the second: per block the
    same figures as building every block (a 1,000,000-layer plan takes seconds, not minutes)."""
    import torch

    from blockformer.models import build_model
    from blockformer.parallel.plan import count, count_at_depth
    from blockformer.stats import EXACT_LAYERS

    m = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=EXACT_LAYERS + 5, d_ff=32, **extra)
    with torch.device("meta"):
        want = count(build_model(m))
    assert count_at_depth(m) == want
