"""The planner against a real run: activation bytes each rank keeps for backward, measured.

    python benchmarks/bench_plan_memory.py            # 1 process, then tp=2 and dp_shard=2 on 2 gloo ranks

For a small Llama-shaped decoder (fp32, no checkpointing) each rank runs one forward of its
micro-batch under the trainer's own wrapping (``parallel.parallelize``: TP with sequence
parallel, FSDP2) and counts the bytes autograd saves inside the blocks (a
``saved_tensors_hooks`` pair; each storage once, parameters left out), next to
``blockformer info --world-size N``'s per-block activation figure (``parallel/plan.py``).
Memory, not time: the figures do not depend on what else the machine runs.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from blockformer.config import TransformerConfig  # noqa: E402
from blockformer.run_config import ParallelConfig, RunConfig, TrainConfig  # noqa: E402

B, S = 8, 256
MODEL = dict(arch="decoder", vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn="swiglu",
             norm="rms", position="rope", bias=False, tie_embeddings=False, max_seq_len=S)


def run_config(tp: int, dp_shard: int) -> RunConfig:
    return RunConfig(model=TransformerConfig(**MODEL),
                     train=TrainConfig(batch_size=B, precision="fp32", activation_checkpointing="none"),
                     parallel=ParallelConfig(tp=tp, dp_shard=dp_shard))


def saved_block_bytes(tp: int, dp_shard: int) -> float:
    """Bytes autograd keeps for backward inside the blocks, per block, on this rank."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from blockformer.models import build_model  # noqa: PLC0415
    from blockformer.parallel import runtime  # noqa: PLC0415
    from blockformer.parallel.fsdp import blocks_of  # noqa: PLC0415

    cfg = run_config(tp, dp_shard)
    par = runtime.start(cfg, torch.device("cpu"))
    model, fwd = runtime.parallelize(build_model(cfg.model, seed=0), cfg, par)
    params = set()
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        params.add(local.untyped_storage().data_ptr())
    seen: dict[int, int] = {}
    active = [False]

    def pack(t):
        if active[0]:
            local = t.to_local() if isinstance(t, DTensor) else t
            store = local.untyped_storage()
            if store.data_ptr() not in params and store.data_ptr() != 0:
                seen[store.data_ptr()] = store.nbytes()
        return t

    blocks = blocks_of(model)
    for b in blocks:
        b.register_forward_pre_hook(lambda *_: active.__setitem__(0, True))
        b.register_forward_hook(lambda *_: active.__setitem__(0, False))
    rows = B // max(dp_shard, 1)
    tokens = torch.randint(4, MODEL["vocab_size"], (rows, S), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), par.loss_context(0.0):
        out = fwd(tokens)
    del out
    return sum(seen.values()) / len(blocks)


def _worker(rank: int, world: int, port: int, tp: int, dp_shard: int, out: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measured = saved_block_bytes(tp, dp_shard)
        if rank == 0:
            Path(out).write_text(str(measured))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(tp: int, dp_shard: int) -> float:
    world = tp * dp_shard
    if world == 1:
        return saved_block_bytes(1, 1)
    with socket.socket() as s, tempfile.TemporaryDirectory() as tmp:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out = str(Path(tmp) / "bytes")
        mp.start_processes(_worker, args=(world, port, tp, dp_shard, out), nprocs=world, start_method="spawn")
        return float(Path(out).read_text())


def planned_block_bytes(tp: int, dp_shard: int) -> float:
    from blockformer.parallel.plan import plan  # noqa: PLC0415

    cfg = run_config(tp, dp_shard)
    p = plan(cfg, tp * dp_shard, batch_size=B, seq_len=S)
    return p["activations_per_block_bytes"]


def main() -> None:
    from common import cpu_kind  # noqa: PLC0415

    torch.set_num_threads(1)
    print(f"model: {MODEL['n_layers']} x d_model {MODEL['d_model']}, swiglu, GQA, fp32; batch {B} x {S} tokens; "
          f"CPU {cpu_kind()}\n")
    print("| layout | ranks | saved per block, measured | planner | planner / measured |")
    print("| --- | --- | --- | --- | --- |")
    for name, tp, dp in (("one process", 1, 1), ("tp=2 (sequence parallel)", 2, 1), ("dp_shard=2 (FSDP2)", 1, 2)):
        got, want = measure(tp, dp), planned_block_bytes(tp, dp)
        print(f"| {name} | {tp * dp} | {got / 2**20:.2f} MiB | {want / 2**20:.2f} MiB | {want / got:.3f} |")


if __name__ == "__main__":
    main()
