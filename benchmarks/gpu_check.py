"""``make gpu-check``: what a machine with a GPU must show, checked and measured in one script.

    python benchmarks/gpu_check.py                  # CUDA: writes benchmarks/results/gpu-check.md
    python benchmarks/gpu_check.py --device cpu     # the same checks on the CPU (gloo): what the suite runs

Each check runs ``blockformer``'s own code on the device and compares it with a peer
computed in the same run; a failed check exits 1, and every figure goes to ``--out``:

1. **fp32 training on the device equals the CPU's**: 4 steps of a small decoder, the losses
   within 1e-4 (relative) of the same run on the CPU.
2. **bf16 training learns**: ``train.precision=bf16`` on the device, the loss falls by 10%+ in
   ``--steps`` steps; tokens per second reported.
3. **Flash attention**: ``scaled_dot_product_attention`` under the flash kernel equals the
   math kernel (bf16, causal, 2e-2), and its time against the math kernel's.
4. **The collective backend** (NCCL on CUDA, gloo on the CPU): FSDP over 2 processes, one per
   GPU, gives the one-process losses within 1e-5, with the NCCL group bound to the rank's
   device (``device_id``). NCCL refuses two ranks on one device, so on a single GPU this runs
   one process, without a process group: NCCL itself is then not exercised.
5. **Decoding**: greedy tokens per second of a GPT-2-small-shaped decoder with the KV cache
   (bf16 on CUDA), a figure for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SMALL = ["data.seq_len=32", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
         "model.bias=false", "train.batch_size=8", "train.warmup=1", "train.lr=1e-3", "train.eval_every=0",
         "train.eval_batches=1", "train.samples=0", "train.progress=false", "train.log_every=1", "train.compile=false"]


def _config(tmp: Path, device: str, *overrides: str):
    from blockformer.run_config import load_run_config  # noqa: PLC0415

    text = tmp / "text.txt"
    if not text.exists():
        rng = torch.Generator().manual_seed(0)
        words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "\n"]
        text.write_text(" ".join(words[i] for i in torch.randint(len(words), (40_000,), generator=rng).tolist()))
    return load_run_config(overrides=[f"data.text={text}", f"data.cache_dir={tmp / 'cache'}", *SMALL,
                                      f"train.device={device}", *overrides])


def _losses(tmp: Path, device: str, out: str, *overrides: str) -> list[float]:
    from blockformer.train.loop import train  # noqa: PLC0415

    return train(_config(tmp, device, *overrides), tmp / out, log=lambda *a: None, overwrite=True).losses


def _worker(rank: int, world: int, port: int, tmp: str, device: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from blockformer.parallel import runtime  # noqa: PLC0415

    seen = {}
    init_mesh = runtime.init_mesh

    def recording(*args, **kwargs):  # the group blockformer itself set up: its backend and bound device
        mesh = init_mesh(*args, **kwargs)
        group = dist.distributed_c10d._get_default_group()
        seen.update(backend=dist.get_backend(), device=str(getattr(group, "bound_device_id", None)))
        return mesh

    runtime.init_mesh = recording
    losses = _losses(Path(tmp), device, "fsdp", "train.steps=4", "train.precision=fp32", f"parallel.dp_shard={world}")
    if rank == 0:
        Path(tmp, "fsdp.json").write_text(json.dumps({"losses": losses, **seen}))


def check_training(tmp: Path, device: str, rows: list) -> None:
    on_device = _losses(tmp, device, "fp32-device", "train.steps=4", "train.precision=fp32")
    on_cpu = _losses(tmp, "cpu", "fp32-cpu", "train.steps=4", "train.precision=fp32")
    worst = max(abs(a - b) / abs(b) for a, b in zip(on_device, on_cpu))
    rows.append(("fp32 training, 4 steps: device losses against the CPU's", f"max relative difference {worst:.2e}",
                 worst <= 1e-4))


def check_bf16(tmp: Path, device: str, steps: int, rows: list) -> None:
    start = time.perf_counter()
    losses = _losses(tmp, device, "bf16", f"train.steps={steps}", "train.precision=bf16")
    seconds = time.perf_counter() - start
    tokens = steps * 8 * 32
    fell = losses[-1] < 0.9 * losses[0] and all(map(lambda v: v == v, losses))
    rows.append((f"bf16 training, {steps} steps: the loss falls", f"{losses[0]:.3f} -> {losses[-1]:.3f}, "
                 f"{tokens / seconds:,.0f} tokens/s (start-up included)", fell))


def check_flash(device: str, quick: bool, rows: list) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    from torch.nn.functional import scaled_dot_product_attention as sdpa  # noqa: PLC0415

    T = 256 if quick else 2048
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(4, 8, T, 64, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))

    def timed(backend: SDPBackend) -> tuple[torch.Tensor, float]:
        with sdpa_kernel(backend):
            out = sdpa(q, k, v, is_causal=True)
            _sync(device)
            start = time.perf_counter()
            for _ in range(5):
                out = sdpa(q, k, v, is_causal=True)
            _sync(device)
        return out, (time.perf_counter() - start) / 5

    flash, t_flash = timed(SDPBackend.FLASH_ATTENTION)
    math, t_math = timed(SDPBackend.MATH)
    diff = (flash.float() - math.float()).abs().max().item()
    rows.append((f"flash attention, bf16, causal, T={T}: against the math kernel",
                 f"max abs difference {diff:.1e}; {t_flash * 1e3:.2f} ms vs {t_math * 1e3:.2f} ms "
                 f"({t_math / t_flash:.1f}x)", diff <= 2e-2))


def check_collective(tmp: Path, device: str, rows: list) -> None:
    world = 2 if device == "cpu" or torch.cuda.device_count() >= 2 else 1
    reference = _losses(tmp, device, "fsdp-ref", "train.steps=4", "train.precision=fp32")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, str(tmp), device), nprocs=world, start_method="spawn")
    got = json.loads(Path(tmp, "fsdp.json").read_text())
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference))
    want = ("nccl", "cuda:0") if device == "cuda" else ("gloo", "None")
    if world == 1:  # a one-GPU machine: one process runs without a process group
        want = ("none", "none")
    backend, bound = got.get("backend", "none"), got.get("device", "none")
    rows.append((f"FSDP on {world} process(es), {backend} bound to {bound}: losses against one process",
                 f"max relative difference {worst:.2e}", worst <= 1e-5 and (backend, bound) == want))


def check_decode(device: str, quick: bool, rows: list) -> None:
    from blockformer.config import TransformerConfig  # noqa: PLC0415
    from blockformer.generate.causal import generate  # noqa: PLC0415
    from blockformer.models import build_model  # noqa: PLC0415

    size = dict(d_model=128, n_layers=2, n_heads=4) if quick else dict(d_model=768, n_layers=12, n_heads=12)
    cfg = TransformerConfig(arch="decoder", vocab_size=50257, max_seq_len=1024, **size)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(cfg, seed=0, device=device).to(dtype).eval()
    n = 16 if quick else 256
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        generate(model, prompt, 4, do_sample=False)
        _sync(device)
        start = time.perf_counter()
        out = generate(model, prompt, n, do_sample=False)
        _sync(device)
    seconds = time.perf_counter() - start
    made = len(out[0])  # the new ids (no eos given: all n of them)
    rows.append((f"greedy decode, {'tiny' if quick else 'GPT-2-small shape'}, batch 1, {n} tokens, {dtype}",
                 f"{made / seconds:,.1f} tokens/s", made == n))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=60, help="bf16 training steps")
    p.add_argument("--quick", action="store_true", help="small shapes (the suite's run on the CPU)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu-check.md")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible (torch.cuda.is_available() is False); expected a machine with a "
              "GPU and a CUDA build of torch (`--device cpu` runs the same checks on the CPU)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows: list[tuple[str, str, bool]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        check_training(tmp, args.device, rows)
        check_bf16(tmp, args.device, args.steps, rows)
        check_flash(args.device, args.quick, rows)
        check_collective(tmp, args.device, rows)
        check_decode(args.device, args.quick, rows)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [f"gpu-check on {name}, torch {torch.__version__}", "", "| check | figure | result |", "| --- | --- | --- |"]
    lines += [f"| {what} | {figure} | {'PASS' if ok else 'FAIL'} |" for what, figure, ok in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
