"""``train.init_from`` into a sharded run: each rank reads only its part of the base (slices of
``model.safetensors``, its own chunks of ``dcp/``), and the shards hold the base's weights, so
that training from them has the losses of a run that loaded the base whole on every rank."""

from __future__ import annotations

import math
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor

from blockformer.parallel import checkpoint as checkpoint_module
from blockformer.parallel import parallelize, start
from blockformer.parallel.checkpoint import dcp_weights
from blockformer.parallel.dcp_reader import _SafePlanner
from blockformer.train import finetune, loop
from blockformer.train.build import build_run_model
from blockformer.train.checkpoint import read_config, resolve_checkpoint

from parallel_helpers import read_json, run_ranks, write_json
from test_parallel_dp import lm_config

UNTIED = ("model.vocab_size=64", "model.tie_embeddings=false")
LAYOUTS = ("parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2")
quiet = lambda *a: None  # noqa: E731


def _counting_reads(read: list[int]) -> None:
    """Every element this process reads from a base: what safetensors' slices return and
    what DCP's plan for this rank asks of ``dcp/``."""
    real_open, real_plan = checkpoint_module.safe_open, _SafePlanner.create_local_plan

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, index):
            t = self.inner[index]
            read.append(t.numel())
            return t

    class File:
        def __init__(self, *args, **kwargs):
            self.outer = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.outer.__enter__()
            return self

        def __exit__(self, *exc):
            return self.outer.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            t = self.inner.get_tensor(key)
            read.append(t.numel())
            return t

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key))

    def plan(self):
        local = real_plan(self)
        read.extend(math.prod(item.lengths) for item in local.items)
        return local

    checkpoint_module.safe_open, _SafePlanner.create_local_plan = File, plan


def _layouts_on_rank(rank: int, tmp: str, base: str, kind: str) -> None:
    tmp_path = Path(tmp)
    if kind == "dcp":  # the base: a sharded run's checkpoint, its weights in dcp/ alone
        loop.train(lm_config(tmp_path, "parallel.dp_shard=2", "train.consolidate=false", *UNTIED), base, log=quiet)
    base_dir = resolve_checkpoint(base)
    whole = (safetensors.torch.load_file(base_dir / "model.safetensors") if kind == "safetensors"
             else dcp_weights(base_dir, read_config(base_dir)))  # for the check only
    read: list[int] = []
    _counting_reads(read)
    results = {}
    vocab = read_config(base_dir).model.vocab_size  # the tokenizer's, as a run from the base resolves it
    for layout in LAYOUTS:
        cfg = lm_config(tmp_path, layout, *UNTIED, f"model.vocab_size={vocab}", f"train.init_from={base}")
        par = start(cfg, torch.device("cpu"))
        model, _ = parallelize(build_run_model(cfg, seed=cfg.train.seed + 1, meta=True), cfg, par)
        read.clear()
        report = finetune.init_sharded(model, cfg, par.rows, log=None)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.state_dict().values())
        mismatched = []
        for name, p in model.state_dict().items():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if not torch.equal(par.rows.to_model(name, full), whole[name]):
                mismatched.append(name)
        results[layout] = {"read": sum(read), "local": local, "total": sum(t.numel() for t in whole.values()),
                           "mismatched": mismatched, "loaded": len(report.loaded), "new": report.new,
                           "stage": sorted(model.state_dict())}
    write_json(tmp_path / f"{kind}-rank{rank}.json", results)


def _check_layouts(tmp_path: Path, kind: str) -> None:
    ranks = [read_json(tmp_path / f"{kind}-rank{r}.json") for r in (0, 1)]
    for layout in LAYOUTS:
        for r in ranks:
            got = r[layout]
            assert got["mismatched"] == [] and got["new"] == [], (kind, layout)
            assert got["read"] == got["local"], (kind, layout)  # its shards' elements, no more
        if layout == "parallel.dp_shard=2":  # FSDP: half of every tensor each
            assert ranks[0][layout]["read"] == ranks[0][layout]["total"] / 2, kind
        elif layout == "parallel.tp=2":  # TP: the matmuls and tables split, the norms whole on both
            assert ranks[0][layout]["total"] / 2 < ranks[0][layout]["read"] < 0.6 * ranks[0][layout]["total"], kind
        else:  # PP: each rank reads its own stages' tensors only
            assert not set(ranks[0][layout]["stage"]) & set(ranks[1][layout]["stage"])
            assert ranks[0][layout]["read"] + ranks[1][layout]["read"] == ranks[0][layout]["total"]


def test_each_rank_reads_only_its_shards_of_a_safetensors_base_and_holds_its_weights(tmp_path):
    base = tmp_path / "base"
    loop.train(lm_config(tmp_path, *UNTIED), base, log=quiet)  # one process: model.safetensors
    run_ranks(2, _layouts_on_rank, str(tmp_path), str(base), "safetensors")
    _check_layouts(tmp_path, "safetensors")


def test_each_rank_reads_only_its_chunks_of_a_dcp_base_and_holds_its_weights(tmp_path):
    run_ranks(2, _layouts_on_rank, str(tmp_path), str(tmp_path / "base"), "dcp")
    _check_layouts(tmp_path, "dcp")


def _train_from_base(rank: int, tmp: str, base: str) -> None:
    tmp = Path(tmp)
    cfg = lambda: lm_config(tmp, "parallel.dp_shard=2", f"train.init_from={base}")  # noqa: E731 - tied table
    parts = loop.train(cfg(), tmp / "parts", log=quiet)
    wanted = loop.meta_init_wanted
    loop.meta_init_wanted = lambda *a: False  # the path that loads the base whole on every rank
    try:
        whole = loop.train(cfg(), tmp / "whole", log=quiet)
    finally:
        loop.meta_init_wanted = wanted
    if rank == 0:
        write_json(tmp / "losses.json", {"parts": parts.losses, "whole": whole.losses})


def test_fsdp_training_from_a_base_read_in_parts_has_the_losses_of_loading_it_whole(tmp_path):
    base = tmp_path / "base"
    loop.train(lm_config(tmp_path), base, log=quiet)
    run_ranks(2, _train_from_base, str(tmp_path), str(base))
    losses = read_json(tmp_path / "losses.json")
    assert len(losses["parts"]) == 3 and losses["parts"] == losses["whole"]  # bit for bit
