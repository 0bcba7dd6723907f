"""``train.init_from`` into a sharded run, and a resume of a one-process checkpoint into one:
each rank reads only its part of the weights (slices of ``model.safetensors``, its own chunks
of ``dcp/``), and the shards hold the checkpoint's weights, so that training from them has the
losses of a run that loaded it whole on every rank."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from blockformer.errors import UsageError
from blockformer.parallel import checkpoint as checkpoint_module
from blockformer.parallel import parallelize, start
from blockformer.parallel.checkpoint import dcp_weights
from blockformer.parallel.dcp_reader import _SafePlanner
from blockformer.train import finetune, loop
from blockformer.train.adapter import recorded_fingerprint
from blockformer.train.build import build_run_model
from blockformer.paths import WEIGHTS
from blockformer.train.checkpoint import resolve_checkpoint
from blockformer.train.load import load_checkpoint, load_trainer_state, read_config
from blockformer.train.optim import build_optimizer

from parallel_helpers import read_json, run_ranks, write_json
from test_parallel_dp import lm_config

UNTIED = ("model.vocab_size=64", "model.tie_embeddings=false")
LAYOUTS = ("parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2")
quiet = lambda *a: None  # noqa: E731


class _Counted:
    """``inner`` (a safetensors slice, or a tensor), each indexing's elements added to ``read``."""

    def __init__(self, inner, read: list[int]):
        self.inner, self.read = inner, read

    def __getitem__(self, index):
        t = self.inner[index]
        self.read.append(t.numel())
        return t


def _counting_reads(read: list[int]) -> None:
    """Every element this process reads from a base: what safetensors' slices return and
    what DCP's plan for this rank asks of ``dcp/``."""
    real_open, real_plan = checkpoint_module.safe_open, _SafePlanner.create_local_plan

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
            return _Counted(self.inner.get_slice(key), read)

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
             else load_checkpoint(base_dir).model.state_dict() if kind.startswith("lora")  # its adapters merged whole
             else dcp_weights(base_dir, read_config(base_dir)))  # for the check only
    read: list[int] = []
    _counting_reads(read)
    hashed = _counting_fingerprints()
    results = {}
    vocab = read_config(base_dir).model.vocab_size  # the tokenizer's, as a run from the base resolves it
    for layout in LAYOUTS:
        cfg = lm_config(tmp_path, layout, *UNTIED, f"model.vocab_size={vocab}", f"train.init_from={base}")
        par = start(cfg, torch.device("cpu"))
        model, _ = parallelize(build_run_model(cfg, seed=cfg.train.seed + 1, meta=True), cfg, par)
        read.clear()
        hashed.clear()
        report = finetune.init_sharded(model, cfg, finetune.parts_of(cfg.train.init_from), par.rows, log=None)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.state_dict().values())
        mismatched = []
        for name, p in model.state_dict().items():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if not torch.equal(par.rows.to_model(name, full), whole[name]):
                mismatched.append(name)
        base_read = sum(read) - (sum(hashed) if kind == "lora-dcp" else 0)  # DCP's plans for the hash counted too
        results[layout] = {"read": base_read, "local": local, "total": sum(t.numel() for t in whole.values()),
                           "mismatched": mismatched, "loaded": len(report.loaded), "new": report.new,
                           "stage": sorted(model.state_dict()), "hashed": sum(hashed)}
    write_json(tmp_path / f"{kind}-rank{rank}.json", results)


def _counting_fingerprints() -> list[int]:
    """Every base element this process hashes to check a LoRA checkpoint's base fingerprint."""
    hashed: list[int] = []
    real = finetune.fingerprint_of

    def counted(entries):
        def blocks(fn):
            for block in fn():
                hashed.append(block.numel())
                yield block

        return real((*entry[:4], lambda fn=entry[4]: blocks(fn)) for entry in entries)

    finetune.fingerprint_of = counted
    return hashed


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


def _sharded_base(rank: int, tmp: str) -> None:
    loop.train(lm_config(Path(tmp), "parallel.dp_shard=2", "train.consolidate=false", *UNTIED), Path(tmp) / "base",
               log=quiet)


def _lora_checkpoint(tmp_path: Path, *overrides: str, base_in: str = "safetensors") -> Path:
    """A one-process LoRA run over a base (one process's ``model.safetensors``, or a sharded
    run's ``dcp/`` alone): adapters on every projection (a gated FFN's gate and up are two parts
    of one weight), trained until ``B A`` is far from zero."""
    base = tmp_path / "base"
    if base_in == "dcp":
        run_ranks(2, _sharded_base, str(tmp_path))
    else:
        loop.train(lm_config(tmp_path, *UNTIED, *overrides), base, log=quiet)
    return loop.train(lm_config(tmp_path, *UNTIED, *overrides, f"train.init_from={base}", "lora.rank=2",
                                "lora.targets=qkv,out,gate,up,down", "lora.alpha=8", "train.lr=3e-2"),
                      tmp_path / "lora", log=quiet).checkpoint


@pytest.mark.parametrize("base_in", ["safetensors", "dcp"])
def test_each_rank_composes_only_its_shards_of_a_lora_checkpoint_merged(tmp_path, base_in):
    lora = _lora_checkpoint(tmp_path, base_in=base_in)
    merged, base = load_checkpoint(lora).model.state_dict(), load_checkpoint(tmp_path / "base").model.state_dict()
    moved = [n for n in base if n.endswith((".qkv.weight", ".out.weight", ".up.weight", ".down.weight"))]
    assert moved and all((merged[n] - base[n]).abs().max() > 1e-3 for n in moved)  # the adapters count
    kind = "lora" if base_in == "safetensors" else "lora-dcp"
    run_ranks(2, _layouts_on_rank, str(tmp_path), str(lora), kind)
    _check_layouts(tmp_path, kind)  # each rank's shards equal the merged weights; it read its block of the base
    ranks = [read_json(tmp_path / f"{kind}-rank{r}.json") for r in (0, 1)]
    for layout in LAYOUTS:  # the base checked against the adapter's fingerprint once, by rank 0, a block at a time
        assert ranks[0][layout]["hashed"] == ranks[0][layout]["total"] and ranks[1][layout]["hashed"] == 0, layout


def test_each_rank_composes_its_shards_of_a_lora_checkpoint_over_a_lora_checkpoint(tmp_path):
    first = _lora_checkpoint(tmp_path)  # adapters over the base's weights
    lora = loop.train(lm_config(tmp_path, *UNTIED, f"train.init_from={first}", "lora.rank=2",
                                "lora.targets=qkv,down", "lora.alpha=8", "train.lr=3e-2"),
                      tmp_path / "lora2", log=quiet).checkpoint  # adapters over those, merged
    merged, under = load_checkpoint(lora).model.state_dict(), load_checkpoint(first).model.state_dict()
    assert all((merged[n] - under[n]).abs().max() > 1e-3 for n in merged if n.endswith((".qkv.weight", ".down.weight")))
    plan = finetune.parts_of(lora).adapted
    assert plan.under is not None and plan.under.under is None  # two adapters, then the weights
    assert finetune._streamed_fingerprint(plan, block_elements=100) == recorded_fingerprint(lora)
    run_ranks(2, _layouts_on_rank, str(tmp_path), str(lora), "lora2")
    _check_layouts(tmp_path, "lora2")  # each rank's shards equal both merges; it read its block of the bottom base
    ranks = [read_json(tmp_path / f"lora2-rank{r}.json") for r in (0, 1)]
    for layout in LAYOUTS:  # the top adapter's fingerprint, over the first one's merged weights, hashed once
        assert ranks[0][layout]["hashed"] == ranks[0][layout]["total"] and ranks[1][layout]["hashed"] == 0, layout


def _refused_on_rank(rank: int, tmp: str, lora: str) -> None:
    cfg = lm_config(Path(tmp), "parallel.dp_shard=2", *UNTIED, f"train.init_from={lora}")
    par = start(cfg, torch.device("cpu"))
    model, _ = parallelize(build_run_model(cfg, meta=True), cfg, par)
    try:
        finetune.init_sharded(model, cfg, finetune.parts_of(cfg.train.init_from), par.rows, log=None)
    except UsageError as e:
        write_json(Path(tmp) / f"refused-rank{rank}.json", str(e))


def test_a_lora_checkpoint_whose_base_changed_is_refused_on_every_rank(tmp_path):
    lora = _lora_checkpoint(tmp_path)
    weights = safetensors.torch.load_file(resolve_checkpoint(tmp_path / "base") / WEIGHTS)
    weights["embed.tokens.weight"][3, 5] += 1e-3  # one element of the base edited since the adapter was trained
    safetensors.torch.save_file(weights, resolve_checkpoint(tmp_path / "base") / WEIGHTS)
    run_ranks(2, _refused_on_rank, str(tmp_path), str(lora))
    for rank in (0, 1):
        assert re.search(r"adapter\.safetensors: its base .* has changed since the adapter was trained",
                         read_json(tmp_path / f"refused-rank{rank}.json")), rank


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


@pytest.mark.parametrize("kind", ["weights", "lora"])
def test_fsdp_training_from_a_base_read_in_parts_has_the_losses_of_loading_it_whole(tmp_path, kind):
    if kind == "lora":  # a tied table: the adapters' base read in parts under its tied names
        base = _lora_checkpoint(tmp_path, "model.tie_embeddings=true")
        assert finetune.parts_of(base).adapted is not None
    else:
        base = tmp_path / "base"
        loop.train(lm_config(tmp_path), base, log=quiet)
    run_ranks(2, _train_from_base, str(tmp_path), str(base))
    losses = read_json(tmp_path / "losses.json")
    assert len(losses["parts"]) == 3 and losses["parts"] == losses["whole"]  # bit for bit


def test_a_tied_lora_checkpoints_base_streamed_from_its_file_has_the_recorded_fingerprint(tmp_path):
    lora = _lora_checkpoint(tmp_path, "model.tie_embeddings=true")
    adapted = finetune._adapted(lora)
    assert any(tied for *_, tied in adapted.fingerprinted)  # the head's name: the table's, hashed once
    assert finetune._streamed_fingerprint(adapted, block_elements=100) == recorded_fingerprint(lora)
    assert finetune.parts_of(lora).adapted is not None
    (resolve_checkpoint(tmp_path / "base") / WEIGHTS).unlink()  # a base without model.safetensors: merged whole
    assert finetune.parts_of(lora) is None


def _one_process_moments(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The AdamW state of one process's ``checkpoint`` keyed by parameter name, through torch's
    own ``get_optimizer_state_dict`` over a one-process model (for the check only)."""
    cfg = read_config(checkpoint)
    model = build_run_model(cfg)
    optimizer = build_optimizer(model, cfg.train, finetune.lr_scale(model, cfg))
    optimizer.load_state_dict(load_trainer_state(checkpoint)["optimizer"])
    return get_optimizer_state_dict(model, optimizer)["state"]


def _counting_moment_reads(read: list[int]) -> None:
    """Every element of a mapped optimizer state that this process copies a block from."""
    real_copy = checkpoint_module._copy_block

    def copy(target, whole, order, scalar=None):
        return real_copy(target, _Counted(whole, read) if torch.is_tensor(whole) else whole, order, scalar)

    checkpoint_module._copy_block = copy


def _resume_on_rank(rank: int, tmp: str, checkpoint: str) -> None:
    tmp_path = Path(tmp)
    whole = safetensors.torch.load_file(Path(checkpoint) / "model.safetensors")  # for the check only
    moments = _one_process_moments(Path(checkpoint))
    read: list[int] = []
    _counting_reads(read)
    moments_read: list[int] = []
    _counting_moment_reads(moments_read)
    results = {}
    for layout in LAYOUTS:
        cfg = lm_config(tmp_path, layout, *UNTIED)
        runtime = start(cfg, torch.device("cpu"))
        read.clear()
        moments_read.clear()
        run = loop._start(cfg, tmp_path / f"resumed-{layout}", runtime, resume=Path(checkpoint), overwrite=False,
                          log=quiet)
        model = run.model
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.state_dict().values())
        mismatched = [name for name, p in model.state_dict().items()
                      if not torch.equal(runtime.rows.to_model(name, p.full_tensor() if isinstance(p, DTensor)
                                                               else p.detach()), whole[name])]
        for name, p in model.named_parameters():
            state = run.optimizer.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                got = state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]
                if isinstance(state[key], DTensor) != isinstance(p, DTensor) or not torch.equal(runtime.rows.to_model(name, got),
                                                                      moments[name][key]):
                    mismatched.append(f"{name}.{key}")
            if not torch.equal(state["step"], moments[name]["step"]):
                mismatched.append(f"{name}.step")
        results[layout] = {"read": sum(read), "local": local, "total": sum(t.numel() for t in whole.values()),
                           "mismatched": mismatched, "new": [], "stage": sorted(model.state_dict()),
                           "moments_read": sum(moments_read),
                           "moments_local": 2 * sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                                                    for p in model.parameters()),
                           "eps": sorted({g["eps"] for g in run.optimizer.param_groups})}
        if run.tracker is not None:
            run.tracker.close()
    write_json(tmp_path / f"resume-rank{rank}.json", results)


def test_a_one_process_checkpoint_resumes_into_shards_each_rank_reading_its_part(tmp_path):
    first = loop.train(lm_config(tmp_path, *UNTIED), tmp_path / "one", stop_at=2, log=quiet)
    state = load_trainer_state(first.checkpoint)
    for group in state["optimizer"]["param_groups"]:  # a saved hyperparameter the config does not give
        group["eps"] = 3e-7
    torch.save(state, first.checkpoint / "trainer_state.pt")
    run_ranks(2, _resume_on_rank, str(tmp_path), str(first.checkpoint))
    _check_layouts(tmp_path, "resume")  # the weights, and the moments (``mismatched``)
    for rank in (0, 1):
        for layout, got in read_json(tmp_path / f"resume-rank{rank}.json").items():
            assert got["moments_read"] == got["moments_local"] > 0, layout  # its part of both moments, no more
            assert got["eps"] == [3e-7], layout  # the saved groups' hyperparameters, as load_state_dict gives them


def _resume_both_ways(rank: int, tmp: str, checkpoint: str) -> None:
    tmp = Path(tmp)
    cfg = lambda: lm_config(tmp, "parallel.dp_shard=2")  # noqa: E731 - tied table
    parts = loop.train(cfg(), tmp / "parts", resume=checkpoint, log=quiet)
    wanted = loop.meta_init_wanted
    loop.meta_init_wanted = lambda *a: False  # the path that loads it whole on every rank
    try:
        whole = loop.train(cfg(), tmp / "whole", resume=checkpoint, log=quiet)
    finally:
        loop.meta_init_wanted = wanted
    if rank == 0:
        write_json(tmp / "resumed.json", {"parts": parts.losses, "whole": whole.losses})


def test_fsdp_resuming_a_one_process_checkpoint_in_parts_has_the_losses_of_loading_it_whole(tmp_path):
    first = loop.train(lm_config(tmp_path), tmp_path / "one", stop_at=2, log=quiet)
    run_ranks(2, _resume_both_ways, str(tmp_path), str(first.checkpoint))
    losses = read_json(tmp_path / "resumed.json")
    assert len(losses["parts"]) == 1 and losses["parts"] == losses["whole"]  # bit for bit


def _resident_file_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) / 1024


@pytest.mark.skipif(checkpoint_module._madvise is None or not Path("/proc/self/status").is_file(),
                    reason="MADV_PAGEOUT is Linux's")
def test_a_mapped_moment_leaves_resident_memory_once_read_and_keeps_its_values(tmp_path):
    torch.save({"m": torch.arange(16 * 2**20, dtype=torch.float32)}, tmp_path / "state.pt")  # 64 MiB
    mapped = torch.load(tmp_path / "state.pt", mmap=True, weights_only=True)["m"]
    before = _resident_file_mib()
    total = float(mapped.sum())  # every page read
    assert _resident_file_mib() - before > 48
    checkpoint_module._page_out(mapped)
    assert _resident_file_mib() - before < 16
    assert float(mapped.sum()) == total  # read again from the file
    anonymous = torch.arange(2**20, dtype=torch.float32)
    checkpoint_module._page_out(anonymous)  # safe on memory that no file backs
    assert torch.equal(anonymous, torch.arange(2**20, dtype=torch.float32))


def test_a_one_process_optimizer_state_over_other_parameters_is_refused_naming_the_file(tmp_path):
    first = loop.train(lm_config(tmp_path, *UNTIED), tmp_path / "one", stop_at=1, log=quiet)
    cfg = read_config(first.checkpoint)
    state = load_trainer_state(first.checkpoint)
    state["optimizer"]["param_groups"][0]["params"].pop()  # one parameter short of this run's
    model = build_run_model(cfg)
    with pytest.raises(UsageError, match=r"trainer_state\.pt: an optimizer over \d+ parameters; expected \d+"):
        finetune.resume_in_parts(model, cfg, first.checkpoint, state, None)
