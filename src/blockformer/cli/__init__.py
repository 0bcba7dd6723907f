"""The ``blockformer`` command: one module per subcommand, imported only when used.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``. Errors a
user can fix (``UsageError``, or a ``ValueError`` from config validation) become one line on
stderr and exit code 2; nothing a user did wrong ends in a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import UsageError

# name -> (module, one-line help). Keep in the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a model from a config, a preset and --set overrides"),
    "generate": ("generate", "generate text from a checkpoint"),
    "translate": ("translate", "translate lines with an encoder-decoder checkpoint"),
    "eval": ("evaluate", "evaluate a checkpoint: loss/perplexity, or BLEU/chrF against references"),
    "info": ("info", "parameters, FLOPs per token and memory for a checkpoint or preset"),
    "average": ("average", "average the weights of several checkpoints"),
    "probe": ("probe", "run one of the seed's claims as an experiment (toy, equivariance, ...)"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="blockformer",
        description="The Transformer's standard block, stacked: train, generate, translate, probe.",
        epilog=f"commands:\n{lines}\n\nRun `blockformer COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    parser.add_argument("--version", action="version", version=_version())
    return parser


def _version() -> str:
    from .. import __version__

    return f"blockformer {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv[:1] or ["--help"])  # prints help or a usage error
        return 2
    name = argv[0]
    module = importlib.import_module(f".{COMMANDS[name][0]}", __name__)
    parser = argparse.ArgumentParser(prog=f"blockformer {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as e:
        if os.environ.get("BLOCKFORMER_DEBUG"):
            raise
        print(f"blockformer {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockformer {name}: interrupted", file=sys.stderr)
        return 130
