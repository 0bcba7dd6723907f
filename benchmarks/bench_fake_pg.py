"""Parameter bytes per rank of ``llama-7b`` and a Llama-2-70B shape on 8, 64 and 512 ranks,
measured from the sharded tensors themselves, beside the planner's figure.

    python benchmarks/bench_fake_pg.py                  # both models, 8/64/512 ranks, FSDP and FSDP x TP 8
    python benchmarks/bench_fake_pg.py --models llama-7b --ranks 8   # smoke

No machine here holds these jobs, so each is simulated in this one process: torch's fake
process group (rank 0 of N; collectives do nothing) under the mesh the trainer would build,
the model built on the meta device (no storage) and parallelised by the trainer's own
``parallelize`` (tensor parallel, then FSDP2). The measured figure is
``sum(p.to_local().numel() * element_size)`` over rank 0's parameters, the heaviest rank
(FSDP2 gives the first ranks the rounded-up rows). The planner's is ``plan()``'s fp32
weights per rank (``blockformer info --world-size N``). The last column is what every
rank held before meta-device initialisation: the whole fp32 model, built before sharding.
"""

from __future__ import annotations

import argparse
import time

from blockformer.parallel.simulate import simulate
from blockformer.parallel.plan import plan
from blockformer.run_config import load_run_config

from common import cpu_kind

LLAMA_70B = ["model.d_model=8192", "model.n_layers=80", "model.n_heads=64", "model.n_kv_heads=8",
             "model.d_ff=28672", "train.name=llama-70b"]  # Llama 2 70B (Touvron et al. 2023), on the 7B preset
MODELS = {"llama-7b": [], "llama-70b": LLAMA_70B}
LAYOUTS = {"FSDP": [], "FSDP x TP 8": ["parallel.tp=8"]}
GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 64, 512])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args()
    print("| model | ranks | layout (dp_shard x tp) | parameters/rank | GiB/rank measured | planner's GiB/rank "
          "| measured / planner | whole model, GiB (built on every rank before) |")
    print("|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for model in args.models:
        for ranks in args.ranks:
            for layout in args.layouts:
                cfg = load_run_config(preset="llama-7b", overrides=MODELS[model] + LAYOUTS[layout])
                got, want = simulate(cfg, ranks), plan(cfg, ranks)
                d = got["layout"]
                planned = want["memory_bytes"]["weights"]
                print(f"| {model} | {ranks} | {layout} ({d['dp_shard']} x {d['tp']}) | {got['parameters_per_rank']:,} "
                      f"| {got['bytes_per_rank'] / GIB:.3f} | {planned / GIB:.3f} | {got['bytes_per_rank'] / planned:.4f} "
                      f"| {4 * got['parameters'] / GIB:.1f} |")
    print(f"\n({time.perf_counter() - t0:.0f} s, CPU {cpu_kind()}; parameters in fp32, rank 0 of each job)")


if __name__ == "__main__":
    main()
