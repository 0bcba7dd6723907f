"""``blockformer probe NAME [--plot FILE] [--json] [probe options]``

Each probe's options are the keyword parameters of its ``run`` function, spelled with
dashes (``train_depth`` -> ``--train-depth``), with the same defaults: the command line and
Python cannot drift apart.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from ..probes import PROBES, probe_module

HELP = {
    "dtype": "float64 or float32",
    "seq_len": "sequence length of the random inputs",
    "pad": "number of padding tokens at the end of the padded inputs",
    "batch_size": "batch size",
    "init_std": "weight init std (larger than training's 0.02 so attention is peaked)",
    "seed": "random seed",
    "depths": "comma-separated stack depths, e.g. 8,16,32,64",
    "variants": "comma-separated variants: pre, post, pre-nores, post-nores, nonorm, nonorm-nores",
    "steps": "training steps on the synthetic task (0: initialisation only)",
    "train_depth": "depth of the stacks that are trained",
    "lr": "peak learning rate (Adam)",
    "warmup": "linear learning-rate warmup steps",
    "d_model": "model width",
    "depth": "number of blocks",
    "norms": "comma-separated norm placements: pre, post",
    "n_symbols": "distinct symbols in the reversal task",
    "seq_lens": "comma-separated sequence lengths for the block's memory and time",
    "rnn_seq_lens": "comma-separated sequence lengths for the block vs LSTM comparison",
    "rnn_batch_size": "batch size for the block vs LSTM comparison",
    "n_heads": "attention heads",
    "n_layers": "blocks (random model)",
    "repeats": "timed repetitions (the median is reported)",
    "device": "cpu or cuda",
    "time_it": "measure times (memory figures are computed either way)",
    "text": "input text (for an encoder-decoder, the source)",
    "target": "encoder-decoder only: the target text fed to the decoder after bos",
    "checkpoint": "checkpoint directory (default: a random model)",
    "preset": "without --checkpoint: build a random model from this preset's [model]",
    "arch": "random model: encoder, decoder or encoder-decoder",
    "position": "random model: none, sinusoidal, learned, rope, alibi or relative",
    "schemes": "comma-separated position schemes: none, sinusoidal, learned, rope, alibi, relative",
    "train_len": "training context T",
    "factors": "comma-separated multiples of T to evaluate at",
    "text_kb": "kilobytes of stdlib text read (the first 90 percent trains, the rest is held out)",
    "eval_windows": "held-out windows averaged",
    "extensions": "also evaluate the trained rope model with linear / NTK scaling and a window of T",
    "image": "a checkpoint reading patches: the index of the held-out test image to show",
    "png": "a checkpoint reading patches: a PNG image to show instead of --image",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run one of the seed's claims as an experiment: a table, --plot FILE, --json."
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of the result")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    sub = parser.add_subparsers(dest="probe", metavar="NAME", required=True)
    for name, claim in PROBES.items():
        module = probe_module(name)
        p = sub.add_parser(name, help=claim, description=(module.__doc__ or claim).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        # Accepted after NAME too; SUPPRESS keeps a value given before NAME.
        p.add_argument("--plot", metavar="FILE", default=argparse.SUPPRESS, help="write a PNG of the result")
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
        for param in inspect.signature(module.run).parameters.values():
            _add_option(p, param)


# Probe options that count things: they must be at least this (the rest: >= 0).
AT_LEAST_ONE = {"seq_len", "batch_size", "depth", "train_depth", "d_model", "n_symbols", "rnn_batch_size",
                "n_heads", "n_layers", "repeats"}
MAX_SIZE = 2**16  # sizes beyond this are typos; they would only fail in the allocator


def check_probe_options(options: dict) -> None:
    """One-line errors for probe options a probe cannot run with (sizes, counts, device)."""
    import math  # noqa: PLC0415

    from ..errors import UsageError  # noqa: PLC0415

    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            low = 1 if name in AT_LEAST_ONE else 0
            if not low <= value <= MAX_SIZE and name != "seed":
                raise UsageError(f"{flag} {value}: expected an integer in [{low}, {MAX_SIZE}]")
            if name == "seed" and not 0 <= value < 2**63:
                raise UsageError(f"{flag} {value}: expected an integer in [0, 2**63)")
        elif isinstance(value, float):
            low_ok = value > 0 if name in ("lr", "init_std") else value >= 0
            if not math.isfinite(value) or not low_ok:
                raise UsageError(f"{flag} {value}: expected a finite float {'> 0' if name in ('lr', 'init_std') else '>= 0'}")
        elif name == "device":
            from ..precision import resolve_device  # noqa: PLC0415

            if value not in ("cpu", "cuda", "auto"):
                raise UsageError(f"--device {value}: expected cpu or cuda")
            if value == "cuda":
                import torch  # noqa: PLC0415

                if not torch.cuda.is_available():
                    raise UsageError("--device cuda: no CUDA device is available; expected cpu")
        elif isinstance(value, str) and ("," in value or name.endswith("s")) and name in LIST_INTS:
            try:
                numbers = [int(v) for v in value.split(",") if v.strip()]
            except ValueError:
                raise UsageError(f"{flag} {value}: expected comma-separated integers, e.g. 8,16,32") from None
            if not numbers or not all(1 <= n <= MAX_SIZE for n in numbers):
                raise UsageError(f"{flag} {value}: expected comma-separated integers in [1, {MAX_SIZE}]")


LIST_INTS = {"depths", "seq_lens", "rnn_seq_lens"}


def _add_option(parser: argparse.ArgumentParser, param: inspect.Parameter) -> None:
    flag = "--" + param.name.replace("_", "-")
    default = param.default
    text = HELP.get(param.name, param.name)
    if isinstance(default, bool):
        if default:
            parser.add_argument("--no-" + flag[2:], dest=param.name, action="store_false",
                                help=f"do not: {text}")
        else:
            parser.add_argument(flag, dest=param.name, action="store_true", help=text)
        return
    kind = type(default) if isinstance(default, (int, float)) else str
    parser.add_argument(flag, dest=param.name, type=kind, default=default, metavar=kind.__name__.upper(),
                        help=f"{text} (default: {default})")


def run(args: argparse.Namespace) -> int:
    from ..paths import check_output_file  # noqa: PLC0415

    module = probe_module(args.probe)
    names = inspect.signature(module.run).parameters
    options = {k: getattr(args, k) for k in names}
    check_probe_options(options)
    plot = None
    if args.plot:
        plot = Path(args.plot)
        check_output_file(plot, "--plot")  # before the experiment runs (a directory is refused)
        plot = plot if plot.suffix else plot.with_suffix(".png")  # what matplotlib writes for a bare name
        check_output_file(plot, "--plot")
    result = module.run(**options)
    print(result.to_json() if args.json else result.table())
    if plot is not None:
        path = result.save_plot(plot)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
