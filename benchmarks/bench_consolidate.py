"""Memory of writing ``model.safetensors`` from a sharded checkpoint: streamed, against loading it whole.

    OMP_NUM_THREADS=1 python benchmarks/bench_consolidate.py

Two FSDP ranks train ``bench_rank_memory``'s 75.9M-parameter decoder for one step with
``train.consolidate=false`` (the checkpoint holds ``dcp/`` only). Then, each in a fresh
process: ``blockformer convert --consolidate`` (the streamed writer: a tensor at a time), and
a one-process ``load_checkpoint`` of the same checkpoint followed by ``safetensors``' own
``save_model`` (what consolidating used to do: the whole model in memory). Each reports its
peak resident memory above the process's start (``ru_maxrss``), and the two files' tensors
are compared.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_rank_memory import OVERRIDES  # noqa: E402
from common import cpu_kind  # noqa: E402

MEASURE = r"""
import resource, sys
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
import safetensors.torch, torch
from blockformer.cli import main
from blockformer.train.load import load_checkpoint
base = rss()
if sys.argv[1] == "streamed":
    assert main(["convert", "--consolidate", sys.argv[2]]) == 0
else:
    safetensors.torch.save_model(load_checkpoint(sys.argv[2]).model, sys.argv[3])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base)
"""


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from blockformer.run_config import load_run_config  # noqa: PLC0415
    from blockformer.train.loop import train  # noqa: PLC0415

    cfg = load_run_config(overrides=[f"data.text={Path(tmp) / 'text.txt'}", f"data.cache_dir={Path(tmp) / 'cache'}",
                                     *OVERRIDES, "train.steps=1", "train.consolidate=false", "parallel.dp_shard=2"])
    train(cfg, Path(tmp) / "run", log=lambda *a: None)


def main() -> None:
    import safetensors.torch  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        letters = "abcdefghijklmnopqrstuvwxyz .,\n"
        rng = torch.Generator().manual_seed(0)
        (tmp / "text.txt").write_text("".join(letters[i] for i in torch.randint(len(letters), (100_000,),
                                                                                  generator=rng).tolist()))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(2, port, str(tmp)), nprocs=2, start_method="spawn")
        ckpt = tmp / "run" / "step-000001"
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        whole_file = tmp / "whole.safetensors"
        got = {}
        for kind in ("whole", "streamed"):
            out = subprocess.run([sys.executable, "-c", MEASURE, kind, str(ckpt), str(whole_file)], env=env,
                                 capture_output=True, text=True, check=True).stdout.split()
            got[kind] = float(out[-1])
        a = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
        b = safetensors.torch.load_file(str(whole_file))
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        params = sum(t.numel() for t in a.values())
        largest = max(t.numel() for t in a.values())
        print(json.dumps({"parameters": params, "weights_mib": 4 * params / 2**20, "largest_tensor_mib": 4 * largest / 2**20,
                          "whole_peak_mib": got["whole"], "streamed_peak_mib": got["streamed"], "same_tensors": same,
                          "cpu_kind": cpu_kind()}))


if __name__ == "__main__":
    main()
