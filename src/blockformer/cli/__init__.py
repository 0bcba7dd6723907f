"""The ``blockformer`` command: one module per subcommand, imported only when used.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``. Errors a
user can fix (``UsageError``, a ``ValueError`` from config validation, an ``OSError`` such
as a full disk or a read-only directory) become one line on stderr and exit code 2;
nothing a user did wrong ends in a traceback. ``EXIT_CODES`` lists every exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import warnings

from ..schema import suggest
from ..errors import UsageError

# name -> (module, one-line help). Keep in the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a model from a config, a preset and --set overrides"),
    "generate": ("generate", "generate text from a checkpoint"),
    "translate": ("translate", "translate lines with an encoder-decoder checkpoint"),
    "serve": ("serve", "serve a checkpoint over OpenAI-compatible HTTP (completions, chat, embeddings)"),
    "eval": ("evaluate", "evaluate a checkpoint: loss/perplexity, or BLEU/chrF against references"),
    "predict": ("predict", "labels and probabilities for texts from a task-head checkpoint"),
    "info": ("info", "parameters, FLOPs per token and memory for a checkpoint or preset"),
    "average": ("average", "average the weights of several checkpoints"),
    "convert": ("convert", "Hugging Face checkpoints in (--from-hf) and out (--to-hf); PEFT adapters (--to-peft, --from-peft)"),
    "probe": ("probe", "run one of the seed's claims as an experiment (toy, equivariance, ...)"),
    "sweep": ("sweep", "train a grid of sizes x token budgets and fit scaling laws to it"),
    "view": ("view", "a local web view of runs (live curves, configs), attention, next tokens; --export DIR"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items())
    parser = _Parser(
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


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage block is behind ``--help``)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_subparsers(self, **kwargs):  # subcommands (probe NAME) report errors the same way
        kwargs.setdefault("parser_class", _Parser)
        return super().add_subparsers(**kwargs)


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit code (see EXIT_CODES)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and not argv[0].startswith("-"):
            hint = suggest(argv[0], list(COMMANDS))
            print(f"blockformer: error: unknown command {argv[0]!r}{hint}; expected one of "
                  + ", ".join(COMMANDS), file=sys.stderr)
            return 2
        try:
            parser.parse_args(argv[:1] or ["--help"])  # prints help, the version or a usage error
        except SystemExit as e:
            return int(e.code or 0)
        return 2
    name = argv[0]
    try:  # the import loads torch, which takes seconds: a Ctrl-C then is an interrupt too
        with _interrupts_held():
            module = importlib.import_module(f".{COMMANDS[name][0]}", __name__)
    except KeyboardInterrupt:
        print(f"blockformer {name}: interrupted", file=sys.stderr)
        return 130
    parser = _Parser(prog=f"blockformer {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    warnings.showwarning = _one_line_warning(name)
    try:
        return int(module.run(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, OSError, MemoryError, OverflowError) as e:
        if os.environ.get("BLOCKFORMER_DEBUG"):
            raise
        print(f"blockformer {name}: error: {describe_error(e)}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except RuntimeError as e:  # the allocators' out-of-memory errors; anything else is a bug
        if os.environ.get("BLOCKFORMER_DEBUG") or not _out_of_memory(e):
            raise
        print(f"blockformer {name}: error: out of memory ({describe_error(e)}); expected smaller sizes",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockformer {name}: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _interrupts_held():
    """A SIGINT during the block is held and raised as KeyboardInterrupt when it ends. Raised
    inside torch's C++ import instead, it can abort the process (pybind11's
    ``error_already_set``) or be lost, and the command would run on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _out_of_memory(e: RuntimeError) -> bool:
    text = str(e).lower()
    return type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text or "out of memory" in text


# What a script can read from the exit status (README, "Safety").
EXIT_CODES = {
    0: "finished (or stopped by train.max_minutes, with a checkpoint saved)",
    1: "a bug: an unexpected error with a traceback (please report it)",
    2: "bad input or a file-system error: one line on stderr names the value or path",
    3: "training stopped: the loss, the gradient, the weights or the validation loss became NaN or infinite "
       "(train.nonfinite=stop); the last finite checkpoint is named",
    4: "a parallel run lost a rank: a collective waited parallel.timeout seconds (or a connection closed); "
       "one line names the ranks that stopped answering",
    130: "stopped by SIGINT (Ctrl-C); a training run saved a checkpoint first",
    143: "stopped by SIGTERM; a training run saved a checkpoint first",
}


def describe_error(e: BaseException) -> str:
    """One line: an OS error as its path and the OS's reason, anything else as its message."""
    if isinstance(e, OSError) and not isinstance(e, UsageError) and e.strerror:
        if not e.filename:
            return e.strerror
        also = f" -> {e.filename2}" if e.filename2 else ""
        return f"{e.filename}{also}: {e.strerror}"
    if isinstance(e, MemoryError):
        return f"out of memory{': ' + str(e) if str(e) else ''}; expected smaller sizes"
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split("\n")[0].split()) if "\n" in text else text


def _one_line_warning(name: str):
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"blockformer {name}: warning: {message}", file=sys.stderr)

    return show
