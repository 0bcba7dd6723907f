"""``blockformer view [RUNS_DIR] [--port N] [--host H] [--server URL] [--export DIR]``

A local web view of the runs under RUNS_DIR (curves, configs, live while training), and
of their checkpoints (attention, next tokens, a playground); with ``--server URL``, of a
running ``blockformer serve`` too (its queue, KV blocks, tokens/s and latencies, and the
playground through it). It listens on 127.0.0.1 unless
told otherwise and prints its URL. ``--export DIR`` writes the runs and attention pages as
static files instead, openable from the file system.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs_dir", nargs="?", default="runs", metavar="RUNS_DIR",
                        help="folder of run directories, or one run directory (default: runs)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8600, help="port to listen on (default: 8600; 0: any free port)")
    parser.add_argument("--server", metavar="URL",
                        help="a running `blockformer serve` (http://127.0.0.1:8000): the server page, and the "
                             "playground through it")
    parser.add_argument("--export", metavar="DIR", help="write the runs and attention pages as static HTML into DIR")
    parser.add_argument("--checkpoint", metavar="RUN/CKPT",
                        help="--export: the checkpoint the attention page shows (default: the first found)")
    parser.add_argument("--text", help="--export: the text the attention page shows")
    parser.add_argument("--target", default="", help="--export, encoder-decoder: the target text after <s>")


def run(args: argparse.Namespace) -> int:
    root = Path(args.runs_dir)
    if not root.is_dir():
        raise UsageError(f"{root}: runs directory not found; expected a folder of runs (`blockformer train` writes "
                         f"runs/NAME)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: expected 0 to 65535")
    if args.export:
        return _export(root, args)
    try:
        import uvicorn
    except ImportError:
        raise UsageError("blockformer view needs fastapi, uvicorn and plotly; pip install 'blockformer[view]'") from None
    from ..view.app import create_app, plotly_js

    plotly_js()  # a missing plotly is a one-line error now, not a broken page later
    app = create_app(root, args.server)
    sock = _bind(args.host, args.port)  # a port in use is one line (exit 2), not uvicorn's log and exit 1
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    _announce(server, args.host, root)
    server.run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); expected a free port "
                         f"(--port 0 picks one)") from None
    return sock


def _export(root: Path, args: argparse.Namespace) -> int:
    from ..view.export import DEFAULT_TEXT, export

    pages = export(root, args.export, args.checkpoint, args.text or DEFAULT_TEXT, args.target)
    for p in pages:
        print(p)
    print(f"open {pages[0].resolve().as_uri()}")
    return 0


def _announce(server, host: str, root: Path) -> None:
    """Print the URL once the socket listens (the port is known then, even for --port 0)."""
    startup = server.startup

    async def started(*a, **k):
        await startup(*a, **k)
        for s in getattr(server, "servers", []):
            for sock in s.sockets:
                port = sock.getsockname()[1]
                shown = f"[{host}]" if ":" in host else host
                print(f"blockformer view: {root} at http://{shown}:{port}/ (Ctrl-C stops)", flush=True)
                return

    server.startup = started
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"blockformer view: warning: listening on {host}: anyone who can reach this machine can read the runs",
              file=sys.stderr)
