"""``blockformer info (--checkpoint DIR | --preset NAME)``: size and cost of a model;
``blockformer info --peak``: this machine's measured matmul peak (what MFU is against)."""

from __future__ import annotations

import argparse
import json

from ..errors import UsageError
from ..run_config import RunConfig, load_run_config, preset_names


MAX_WORLD_SIZE = 2**20  # ranks: past any cluster a plan describes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Parameters, training FLOPs per token and a training-memory estimate for one micro-batch, "
        "for a checkpoint or a preset (with --set overrides)."
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", metavar="DIR", help="a checkpoint or run directory")
    source.add_argument("--preset", metavar="NAME", help="one of: " + ", ".join(preset_names()))
    source.add_argument("--config", metavar="CONFIG.toml", help="a TOML run config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B", help="default: train.batch_size")
    parser.add_argument("--seq-len", type=int, default=None, metavar="T",
                        help="default: data.seq_len (language modelling) or model.max_seq_len")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="also plan a parallel run on N ranks laid out by the [parallel] section "
                             "(--set parallel.tp=8 ...): per-rank memory and communication per step")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--peak", action="store_true",
                        help="measure this machine's matmul peak FLOP/s in fp32 and bf16 (cached for MFU) and its "
                             "memory bandwidth (what bounds a batch-1 decode step)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="for --peak")


def model_info(cfg: RunConfig, batch_size: int | None = None, seq_len: int | None = None) -> dict:
    """The figures ``info`` prints, from arithmetic and a model built on the meta device (no
    memory is allocated; a very deep config is extrapolated from two small depths)."""
    from ..probes.memory import machine_memory_bytes, size_estimate  # noqa: PLC0415
    from ..stats import flops_per_token  # noqa: PLC0415

    m = cfg.model
    T = seq_len if seq_len is not None else (cfg.data.seq_len if m.arch == "decoder" else m.max_seq_len)
    if batch_size is None and m.arch == "encoder-decoder" and cfg.data.kind != "task":
        batch_size = max(1, cfg.train.max_tokens // T)  # batches of aligned pairs are sized by tokens
    B = cfg.train.batch_size if batch_size is None else batch_size
    for flag, value in (("--batch-size", B), ("--seq-len", T)):
        if not 1 <= value <= 2**40:
            raise UsageError(f"{flag} {value}: expected an integer in [1, 2**40]")
    size = size_estimate(m, B, T)
    return {
        "arch": m.arch,
        "layers": m.total_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "d_ff": m.d_ff,
        "vocab_size": m.vocab_size,
        "parameters": size["parameters"],
        "parameters_without_embeddings": size["parameters_without_embeddings"],
        "active_parameters": size["active_parameters"],
        "flops_per_token": flops_per_token(m, T),
        "batch_size": B,
        "seq_len": T,
        "memory_bytes": size["memory_bytes"],
        "machine_memory_bytes": machine_memory_bytes(),
    }


def run(args: argparse.Namespace) -> int:
    if args.peak:
        peaks = measure_peaks(args.device)
        if not (args.checkpoint or args.preset or args.config):
            _print_peaks(peaks, args.json)
            return 0
        _print_peaks(peaks, False)
    elif not (args.checkpoint or args.preset or args.config):
        raise UsageError("info: expected --checkpoint DIR, --preset NAME, --config FILE or --peak")
    if args.checkpoint:
        from ..train.checkpoint import resolve_checkpoint  # noqa: PLC0415
        from ..train.load import read_config  # noqa: PLC0415

        if args.overrides:
            raise UsageError("--set: applies to --preset or --config, not to a trained checkpoint")
        cfg = read_config(resolve_checkpoint(args.checkpoint))
    else:
        cfg = load_run_config(args.config, args.preset, args.overrides)
    info = model_info(cfg, args.batch_size, args.seq_len)
    if args.world_size is not None:
        from ..parallel.plan import format_plan, plan  # noqa: PLC0415

        if not 1 <= args.world_size <= MAX_WORLD_SIZE:
            raise UsageError(f"--world-size {args.world_size}: expected an integer in [1, {MAX_WORLD_SIZE}]")
        info["plan"] = plan(cfg, args.world_size, args.batch_size, args.seq_len)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    mem = info["memory_bytes"]
    m = cfg.model
    layers = f"{m.n_encoder_layers}+{m.n_decoder_layers}" if m.arch == "encoder-decoder" else m.n_layers
    ffn = f"{m.ffn_experts} experts of d_ff {m.expert_d_ff}, top-{m.experts_top_k}" if m.ffn_experts else f"d_ff {m.d_ff}"
    print(f"arch         {m.arch}: {layers} layers, d_model {m.d_model}, {m.n_heads} heads, "
          f"{ffn}" + (f", vocab {m.vocab_size}" if m.input == "tokens" or m.arch != "encoder" else ""))
    from ..models.inputs import describe_parts  # noqa: PLC0415
    from ..train.build import pooling_for  # noqa: PLC0415

    for part, text in describe_parts(m, cfg.head.task, pooling_for(cfg)).items():
        print(f"{part:<12} {text}")
    print(f"parameters   {info['parameters']:,} "
          f"({info['parameters_without_embeddings']:,} without embeddings)")
    if m.ffn_experts:
        print(f"active       {info['active_parameters']:,} per token ({m.experts_top_k} of {m.ffn_experts} "
              f"experts{f' + {m.shared_experts} shared' if m.shared_experts else ''}); FLOPs count these")
    print(f"FLOPs/token  {info['flops_per_token']:.3e} "
          f"(training: forward + backward, seq_len {info['seq_len']})")
    print(f"memory       {_gib(mem['total_bytes'])} for a micro-batch of {info['batch_size']} x "
          f"{info['seq_len']} in fp32: weights {_gib(mem['weights_bytes'])}, optimizer+grads "
          f"{_gib(mem['optimizer_bytes'])}, activations {_gib(mem['activation_bytes'])}")
    ram = info["machine_memory_bytes"]
    if ram is not None and mem["total_bytes"] > ram:
        print(f"note         more than this machine's {_gib(ram)} of RAM: `blockformer train` refuses it here")
    for line in format_plan(info["plan"]) if "plan" in info else []:
        print(line)
    if not args.checkpoint and cfg.data.tokenizer in ("char", "bpe"):
        print(f"note         vocab_size is the config's; training sets it from the {cfg.data.tokenizer} "
              "tokenizer")
    return 0


def measure_peaks(device_name: str) -> dict:
    """Matmul peak FLOP/s per precision and streaming-read bytes/s on ``device_name``, measured
    now (and cached)."""
    from ..precision import native_bf16, resolve_device  # noqa: PLC0415
    from ..train.throughput import machine_key, memory_bandwidth, peak_flops  # noqa: PLC0415

    device = resolve_device(device_name)
    precisions = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    peaks = {p: peak_flops(device, p, refresh=True) for p in precisions}
    return {"device": str(device), "machine": machine_key(device), "native_bf16": native_bf16(device),
            "peak_flops": peaks, "read_bytes_per_s": memory_bandwidth(device, refresh=True)}


def _print_peaks(peaks: dict, as_json: bool) -> None:
    from ..train.throughput import READ_MIB, format_bytes_per_s, format_flops  # noqa: PLC0415

    if as_json:
        print(json.dumps(peaks, indent=2))
        return
    print(f"machine      {peaks['machine']}")
    for precision, value in peaks["peak_flops"].items():
        note = " (emulated: no bf16 units)" if precision == "bf16" and not peaks["native_bf16"] else ""
        print(f"peak {precision:<7} {format_flops(value)}{note}  (best square matmul; MFU is against this)")
    mib = READ_MIB["cuda" if peaks["device"].startswith("cuda") else "cpu"]
    print(f"bandwidth    {format_bytes_per_s(peaks['read_bytes_per_s'])}  (streaming read of {mib} MiB; a batch-1 "
          "decode step reads every weight once, so tokens/s <= this / weight bytes)")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
