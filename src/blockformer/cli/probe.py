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
    module = probe_module(args.probe)
    names = inspect.signature(module.run).parameters
    result = module.run(**{k: getattr(args, k) for k in names})
    print(result.to_json() if args.json else result.table())
    if args.plot:
        path = result.save_plot(Path(args.plot))
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
