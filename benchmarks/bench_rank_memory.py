"""Peak memory per rank of a real sharded training run, 1 vs 2 vs 4 processes, beside the planner.

    OMP_NUM_THREADS=1 python benchmarks/bench_rank_memory.py          # 1, 2, 4 and 8 gloo ranks, FSDP
    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/bench_rank_memory.py   # freed memory returned
    OMP_NUM_THREADS=1 python benchmarks/bench_rank_memory.py --init-from --worlds 2,4    # from a base checkpoint
    OMP_NUM_THREADS=1 python benchmarks/bench_rank_memory.py --resume --worlds 2,4       # resuming one process's
    OMP_NUM_THREADS=1 python benchmarks/bench_rank_memory.py --init-from-lora --worlds 2,4   # from a LoRA checkpoint

Each rank trains a 75M-parameter Llama-shaped decoder (fp32, AdamW) for a few steps with
``blockformer``'s own ``train`` (FSDP2 over ``dp_shard = N``, meta-device initialisation, a
sharded checkpoint with its streamed ``model.safetensors`` at the end) and reports its peak
resident memory (``VmHWM``) above what the process held once torch, the data and the
process group were up. Beside it: ``blockformer info --world-size N``'s per-rank total
(weights, gradients, AdamW moments, the gathered block, activations) for the same run, and
the same run built whole on every rank before sharding (meta-device init off: what every
rank did before issue 26). The batch is small, so the states dominate. glibc keeps freed
memory for reuse, so a rank's resident peak runs above what its tensors ever held at once;
with ``MALLOC_MMAP_THRESHOLD_=65536`` large blocks go back to the system when freed and the
peak follows the tensors. ``--init-from``: every run starts from a base checkpoint of the
same model (``train.init_from``, one process's ``model.safetensors``): each rank reads its part
of it into its shards, beside the same run loading the base whole on every rank first.
``--resume``: every run resumes one process's checkpoint of the same model (weights in
``model.safetensors``, AdamW moments in ``trainer_state.pt``) into its own layout: each rank
reads its part of both, beside the same resume loading them whole on every rank first.
``--init-from-lora``: every run starts from a LoRA checkpoint (rank-16 adapters on every
projection, one step, over that base): each rank composes its part of the merged weights
(its block of the base, plus its block of ``scale * B A``) and rank 0 streams the base through
the adapter's fingerprint check, beside the same run merging it whole on every rank first.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

STEPS = 3
OVERRIDES = [
    "data.seq_len=64", "model.d_model=768", "model.n_layers=8", "model.n_heads=12", "model.n_kv_heads=12",
    "model.d_ff=3072", "model.ffn=swiglu", "model.norm=rms", "model.position=rope", "model.bias=false",
    "model.tie_embeddings=false", "model.max_seq_len=64", "train.batch_size=8", "train.grad_accum=1",
    f"train.steps={STEPS}", "train.eval_every=0", "train.eval_batches=1", "train.samples=0", "train.progress=false",
    "train.precision=fp32", "train.compile=false", "train.warmup=1",
]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _peak_mib() -> float:
    """This process's resident peak (``VmHWM``: unlike ``ru_maxrss``, not carried over from the
    parent through ``spawn``'s exec, so a parent that built the base does not set it)."""
    return _status_mib("VmHWM")


def _run(tmp: Path, world: int, meta: bool, init_from: str = "", resume: str = "") -> dict:
    from blockformer.parallel import runtime  # noqa: PLC0415
    from blockformer.run_config import load_run_config  # noqa: PLC0415
    from blockformer.train import loop  # noqa: PLC0415

    before_save = []
    for kind in (runtime.Parallel, runtime.Local):
        def save(self, *args, _save=kind.save, **kwargs):
            before_save.append(_peak_mib())
            return _save(self, *args, **kwargs)
        kind.save = save
    started = []

    def start(*args, _start=loop._start, **kwargs):  # the model built (and the base read), not yet trained
        run = _start(*args, **kwargs)
        started.append(_peak_mib())
        return run
    loop._start = start
    if not meta:
        loop.meta_init_wanted = lambda *a, **k: False  # the whole model on every rank, then sharded
    cfg = load_run_config(overrides=[f"data.text={tmp / 'text.txt'}", f"data.cache_dir={tmp / 'cache'}", *OVERRIDES,
                                     f"parallel.dp_shard={world}", f"train.init_from={init_from}"])
    if world > 1:
        import torch.distributed as dist  # noqa: PLC0415
        dist.barrier()
    base = _rss_mib()
    loop.train(cfg, tmp / f"run-{world}-{int(meta)}", resume=resume or None, log=lambda *a: None)
    peak = _peak_mib()
    return {"base": base, "start": started[0], "train": before_save[0], "peak": peak}


def _worker(rank: int, world: int, port: int, tmp: str, meta: bool, init_from: str, resume: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        got = _run(Path(tmp), world, meta, init_from, resume)
        Path(tmp, f"rank-{world}-{int(meta)}-{rank}.json").write_text(json.dumps(got))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(tmp: Path, world: int, meta: bool = True, init_from: str = "", resume: str = "") -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, str(tmp), meta, init_from, resume), nprocs=world, start_method="spawn")
    return [json.loads(Path(tmp, f"rank-{world}-{int(meta)}-{r}.json").read_text()) for r in range(world)]


def planned(tmp: Path, world: int) -> dict:
    from blockformer.parallel.plan import plan  # noqa: PLC0415
    from blockformer.run_config import load_run_config  # noqa: PLC0415

    cfg = load_run_config(overrides=[f"data.text={tmp / 'text.txt'}", *OVERRIDES, "model.vocab_size=256",
                                     f"parallel.dp_shard={world}"])
    return plan(cfg, world)


def main() -> None:
    import argparse  # noqa: PLC0415

    from common import cpu_kind  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1,2,4,8", help="process counts, comma-separated")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--init-from", action="store_true", help="every run starts from a base checkpoint")
    start.add_argument("--resume", action="store_true", help="every run resumes one process's checkpoint")
    start.add_argument("--init-from-lora", action="store_true", help="every run starts from a LoRA checkpoint")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rng = torch.Generator().manual_seed(0)
        letters = "abcdefghijklmnopqrstuvwxyz .,\n"
        text = "".join(letters[i] for i in torch.randint(len(letters), (200_000,), generator=rng).tolist())
        (tmp / "text.txt").write_text(text, encoding="utf-8")
        base = ""
        if args.init_from or args.resume or args.init_from_lora:  # the base: this model after one step of one process
            from blockformer.run_config import load_run_config  # noqa: PLC0415
            from blockformer.train import loop  # noqa: PLC0415

            steps = [f"data.text={tmp / 'text.txt'}", f"data.cache_dir={tmp / 'cache'}",
                     *(o for o in OVERRIDES if not o.startswith("train.steps=")), "train.steps=1"]
            loop.train(load_run_config(overrides=steps), tmp / "base", log=lambda *a: None)
            base = str(tmp / "base")
            if args.init_from_lora:
                lora = [f"train.init_from={base}", "lora.rank=16", "lora.targets=qkv,out,gate,up,down"]
                loop.train(load_run_config(overrides=[*steps, *lora]), tmp / "lora", log=lambda *a: None)
                base = str(tmp / "lora")
        start = {"resume": base} if args.resume else {"init_from": base}
        p1 = planned(tmp, 1)
        print(f"model: {p1['parameters']:,} parameters (fp32 weights + gradients + AdamW: "
              f"{16 * p1['parameters'] / 2**20:,.0f} MiB whole); batch 8 x 64 tokens, {STEPS} steps + one checkpoint; "
              f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}; CPU {cpu_kind()}"
              f"{'; every run resumes a one-process checkpoint' if args.resume else ''}"
              f"{'; every run train.init_from a base checkpoint' if args.init_from else ''}"
              f"{'; every run train.init_from a LoRA checkpoint over a base' if args.init_from_lora else ''}\n")
        whole_first = ("weights loaded whole first" if args.resume else "merged whole first" if args.init_from_lora
                       else "base loaded whole first" if base else "built whole first")
        print("| ranks | layout | set-up: peak above start, per rank (MiB) | training: peak above start, per rank "
              "(MiB) | planner total/rank (MiB) | measured / planner | with the checkpoint save (MiB) "
              f"| {whole_first}: set-up, training (MiB) |")
        print("| ---: | --- | --- | --- | ---: | ---: | --- | --- |")
        for world in worlds:
            if world == 1:  # one process: torch.multiprocessing keeps the same accounting
                got = measure(tmp, 1, **start)
                whole = None
            else:
                got, whole = measure(tmp, world, **start), measure(tmp, world, meta=False, **start)
            growth = [g["train"] - g["base"] for g in got]
            saving = ", ".join(f"{g['peak'] - g['base']:.0f}" for g in got)
            want = planned(tmp, world)["memory_bytes"]["total"] / 2**20
            setup = ", ".join(f"{g['start'] - g['base']:.0f}" for g in got)
            before = "-" if whole is None else (", ".join(f"{g['start'] - g['base']:.0f}" for g in whole) + "; "
                                                + ", ".join(f"{g['train'] - g['base']:.0f}" for g in whole))
            print(f"| {world} | {'one process' if world == 1 else f'FSDP dp_shard={world}'} | {setup} | "
                  f"{', '.join(f'{g:.0f}' for g in growth)} | {want:.0f} | {max(growth) / want:.2f} | {saving} | {before} |")


if __name__ == "__main__":
    main()
