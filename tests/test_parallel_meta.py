"""Meta-device initialisation: a model built on ``meta``, sharded, then filled in holds exactly
the weights of a one-process build, each rank only its shards; and, past this machine, the
shards of ``llama-7b`` over a fake process group are what the planner says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from blockformer.config import TransformerConfig
from blockformer.models import build_model
from blockformer.parallel import meta, parallelize, simulate, start
from blockformer.parallel.plan import plan
from blockformer.run_config import load_run_config
from blockformer.train import loop
from blockformer.train.build import build_run_model

from parallel_helpers import read_json, run_ranks, start_processes, write_json
from test_parallel_dp import lm_config

SMALL = dict(d_model=32, n_heads=4, vocab_size=50)
MODELS = {
    "gpt (tied, learned biases)": TransformerConfig(arch="decoder", n_layers=2, **SMALL),
    "llama (gqa, swiglu, untied)": TransformerConfig(arch="decoder", n_layers=2, n_kv_heads=2, ffn="swiglu",
                                                     norm="rms", bias=False, tie_embeddings=False, **SMALL),
    "bert (types, pooler)": TransformerConfig(arch="encoder", n_layers=2, position="learned", n_token_types=2,
                                              embedding_norm=True, pooler=True, **SMALL),
    "t5 (relative bias)": TransformerConfig(arch="encoder-decoder", n_encoder_layers=2, n_decoder_layers=2,
                                            position="relative", **SMALL),
    "alibi (buffer from torch.tensor)": TransformerConfig(arch="decoder", n_layers=2, position="alibi", **SMALL),
    "sinusoidal (buffer)": TransformerConfig(arch="decoder", n_layers=2, position="sinusoidal", **SMALL),
    "moe": TransformerConfig(arch="decoder", n_layers=2, ffn_experts=4, **SMALL),
    "deepnet (rescaled after the draw)": TransformerConfig(arch="decoder", n_layers=2, residual="scaled",
                                                           residual_scale_target="trunk", norm_position="post",
                                                           **SMALL),
    "vit (class token from randn)": TransformerConfig(arch="encoder", n_layers=2, input="patches", cls_token=True,
                                                      d_model=32, n_heads=4),
}


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_meta_build_replayed_holds_the_one_process_weights_bit_for_bit(name):
    cfg = MODELS[name]
    torch.manual_seed(3)
    ref = build_model(cfg)
    torch.manual_seed(3)
    model = meta.build_on_meta(lambda: build_model(cfg))
    assert all(p.is_meta for p in model.parameters())
    log = meta.materialize(model, "cpu")
    want, got = state(ref), state(model)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    if cfg.residual == "plain" and cfg.position != "sinusoidal":  # what the replay held whole at once
        assert log.peak_bytes == max(p.numel() * 4 for p in ref.parameters())
    assert ties(model) == ties(ref)  # a tied table is one parameter again after to_empty


def ties(model: torch.nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(names for names in groups.values() if len(names) > 1)


def _sharded_weights_on_rank(rank: int, tmp: str, layout: str) -> None:
    cfg = lm_config(Path(tmp), layout, "model.vocab_size=64", "model.tie_embeddings=false")
    ref = build_run_model(cfg, seed=cfg.train.seed)  # the one-process build (whole, for the check only)
    par = start(cfg, torch.device("cpu"))
    model = build_run_model(cfg, seed=cfg.train.seed, meta=True)
    model, _ = parallelize(model, cfg, par)
    assert not meta.pending(model) and not any(p.is_meta for p in model.parameters())
    def share(p: torch.Tensor) -> int:  # a parameter's bytes over the ranks its placements split it across
        ways = 1
        for i, placement in enumerate(getattr(p, "placements", ())):
            ways *= p.device_mesh.size(i) if placement.is_shard() else 1
        return p.numel() * 4 // ways

    local = [(p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters()]
    result = {"local": sum(local), "share": sum(share(p) for p in model.parameters()),
              "total": sum(p.numel() * 4 for p in ref.parameters()), "mismatched": [],
              "stage": sum(ref.get_parameter(n).numel() * 4 for n, _ in model.named_parameters())}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if not torch.equal(par.rows.to_model(name, full), ref.get_parameter(name).detach()):
            result["mismatched"].append(name)
    if rank == 0:
        write_json(Path(tmp) / f"{layout}.json", result)


def _both_layouts(rank: int, tmp: str) -> None:
    for layout in ("parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2"):
        _sharded_weights_on_rank(rank, tmp, layout)


def test_meta_initialised_fsdp_and_tp_shards_gather_to_the_one_process_weights(tmp_path):
    run_ranks(2, _both_layouts, str(tmp_path))
    for layout in ("parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2"):
        r = read_json(tmp_path / f"{layout}.json")
        assert r["mismatched"] == [], layout
        assert r["local"] == r["share"], layout  # each rank allocated its shards only (shapes divide evenly)
        if layout == "parallel.dp_shard=2":  # FSDP: every parameter split in two
            assert r["local"] == r["total"] / 2
        elif layout == "parallel.tp=2":  # TP: the matmuls and tables split, the norms whole
            assert r["total"] / 2 < r["local"] < 0.6 * r["total"]
        else:  # PP: rank 0 holds the embedding and the first block, not the second block and the head
            assert r["local"] == r["stage"] < 0.75 * r["total"]


def _train_both_ways(rank: int, tmp: str) -> None:
    tmp = Path(tmp)
    on = loop.train(lm_config(tmp, "parallel.dp_shard=2"), tmp / "meta", log=lambda *a: None)
    wanted = loop.meta_init_wanted
    loop.meta_init_wanted = lambda *a: False  # the path that builds the whole model on every rank
    try:
        off = loop.train(lm_config(tmp, "parallel.dp_shard=2"), tmp / "whole", log=lambda *a: None)
    finally:
        loop.meta_init_wanted = wanted
    if rank == 0:
        write_json(tmp / "losses.json", {"meta": on.losses, "whole": off.losses})


def test_fsdp_training_from_a_meta_build_has_the_losses_of_a_whole_build(tmp_path):
    run_ranks(2, _train_both_ways, str(tmp_path))
    losses = read_json(tmp_path / "losses.json")
    assert len(losses["meta"]) == 3 and losses["meta"] == losses["whole"]  # bit for bit


FSDP_X_TP = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn=swiglu",
             "model.vocab_size=64", "model.tie_embeddings=false", "model.bias=false", "parallel.dp_shard=2",
             "parallel.tp=2", "train.precision=fp32"]


def _simulated_rank(index: int, first: int, tmp: str) -> None:
    """Rank ``first + index`` of 4 over the fake group, in a process of its own (torch keeps
    mesh state between groups of one process): its shards, saved."""
    torch.set_num_threads(1)
    cfg = load_run_config(overrides=FSDP_X_TP)
    with simulate.fake_group(4, first + index):
        model, _ = parallelize(build_run_model(cfg, seed=5, meta=True), cfg, start(cfg, torch.device("cpu")))
        torch.save({name: p.to_local().detach().clone() for name, p in model.named_parameters()},
                   Path(tmp) / f"rank{first + index}.pt")


def test_fsdp_x_tp_shards_of_four_simulated_ranks_hold_the_one_process_values_between_them(tmp_path):
    """dp_shard 2 x tp 2 (FSDP over TP: 2-D placements) needs 4 ranks; each is simulated over
    the fake group, two processes at a time. Whatever the placements, the ranks' shards of a
    parameter hold its one-process values between them, each as often as it is replicated."""
    for first in (0, 2):
        start_processes(_simulated_rank, (first, str(tmp_path)), 2)
    ref = dict(build_run_model(load_run_config(overrides=FSDP_X_TP), seed=5).named_parameters())
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert shards[0].keys() == ref.keys()
    for name, want in ref.items():
        parts = [s[name] for s in shards]
        assert all(part.numel() * 2 <= want.numel() for part in parts), name  # FSDP splits each, TP the matmuls too
        got = torch.cat([part.flatten() for part in parts]).sort().values
        copies = got.numel() // want.numel()  # the norms: replicated over tp, sharded over dp
        assert torch.equal(got, want.detach().flatten().repeat(copies).sort().values), name


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is already running in this process")
def test_llama_7b_sharded_over_8_fake_ranks_holds_the_planners_parameters():
    cfg = load_run_config(preset="llama-7b")
    got = simulate.simulate(cfg, 8)
    want = plan(cfg, 8)
    assert got["parameters"] == want["parameters"] == 6_738_415_616
    assert got["parameters_per_rank"] == want["parameters_per_rank"] == got["parameters"] / 8  # no padding here
    assert got["bytes_per_rank"] == want["memory_bytes"]["weights"]  # fp32 master weights
