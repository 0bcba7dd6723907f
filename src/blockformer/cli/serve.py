"""``blockformer serve --checkpoint DIR``: an OpenAI-compatible HTTP server for a checkpoint.

A decoder answers ``/v1/completions`` and ``/v1/chat/completions`` (chat needs a template:
the checkpoint's ``chat_template.jinja`` or ``--chat-template FILE``), an encoder
``/v1/embeddings``, an encoder-decoder ``/v1/translations``; every server has
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus). Requests share the engine's
continuous batch and its paged KV cache (``--block-size``, ``--num-blocks``, ``--kv-cache-dtype``,
``--max-num-batched-tokens`` per step, ``--max-running``, ``--max-queued`` before a 429).

On start it prints the URL and a ``curl`` line that works. Ctrl-C (or SIGTERM) stops
taking connections, lets the requests in flight finish, and exits 0; a second Ctrl-C stops
at once. ``--port 0`` takes any free port (the printed URL names it).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import json
import shlex
import signal
import socket
import threading

from ..errors import UsageError

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "jinja2")  # pyproject's `serve` extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .translate import add_kv_cache_argument, add_quantize_argument  # noqa: PLC0415

    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint or run directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV-cache block")
    parser.add_argument("--num-blocks", type=int, default=None, metavar="N",
                        help="KV-cache blocks in the pool (default: the engine sizes it)")
    add_kv_cache_argument(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="N",
                        help="token budget of one engine step (prefill chunks + decodes; default 512)")
    parser.add_argument("--max-running", type=int, default=64, metavar="N",
                        help="requests in the batch at once (default 64: on a CPU, throughput still grows there)")
    parser.add_argument("--max-queued", type=int, default=256, metavar="N",
                        help="requests waiting before new ones get 429 (default 256)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks of equal prefixes")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template (default: the checkpoint's own, if any)")
    parser.add_argument("--model-name", default=None, help="the name clients send as `model` (default: the "
                        "checkpoint directory's name)")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    add_quantize_argument(parser)


def run(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415

    from ..precision import check_precision, resolve_device  # noqa: PLC0415

    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"serve: {', '.join(missing)} not installed; expected the serve extra "
                         "(pip install 'blockformer[serve]')")
    from ..serve.api import build_app  # noqa: PLC0415
    from ..serve.async_engine import AsyncEngine  # noqa: PLC0415
    from ..serve.chat_template import compile_chat_template  # noqa: PLC0415
    from ..serve.engine import Engine  # noqa: PLC0415

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: expected an integer in [0, 65535] (0: any free port)")
    for flag in ("block_size", "max_num_batched_tokens", "max_running", "max_queued", "num_blocks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: expected an integer >= 1")
    if args.model_name is not None and not args.model_name.strip():
        raise UsageError("--model-name '': expected a name")
    template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:  # a missing file: one line naming it
            template = f.read()
        compile_chat_template(template, f"--chat-template {args.chat_template}")
    device = resolve_device(args.device, "--device")
    check_precision(args.precision, device, "--precision")
    sock = _bind(args.host, args.port)  # before the model loads: a port in use fails fast
    try:
        options = {"model_name": args.model_name} if args.model_name else {}
        engine = Engine.from_checkpoint(
            args.checkpoint, device=device, precision=args.precision, quantize=args.quantize,
            chat_template=template, block_size=args.block_size, num_blocks=args.num_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens, max_running=args.max_running,
            max_queued=args.max_queued, prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype, **options)
        aeng = AsyncEngine(engine)
        app = build_app(aeng, model_name=engine.model_name, chat_template=engine.chat_template)
        asyncio.run(_serve(app, aeng, sock, _banner(sock, engine)))
    finally:
        sock.close()
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket; an address in use or not on this machine is a ``UsageError``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}; expected an address of this machine") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {port}: already in use on {host}; expected a free port "
                             "(or --port 0 for any)") from None
        raise UsageError(f"--host {host} --port {port}: {e.strerror}; expected an address to listen on") from None
    return sock


def _banner(sock: socket.socket, engine) -> str:
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    if engine.arch == "encoder":
        route, body = "/v1/embeddings", {"model": engine.model_name, "input": "Hello"}
    elif engine.arch == "encoder-decoder":
        route, body = "/v1/translations", {"model": engine.model_name, "input": "Hello"}
    else:
        route, body = "/v1/completions", {"model": engine.model_name, "prompt": "Hello", "max_tokens": 16}
    curl = f"curl {url}{route} -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"
    return f"blockformer serve: {engine.model_name} ({engine.arch}) at {url}\n  try: {curl}"


async def _serve(app, aeng, sock: socket.socket, banner: str) -> None:
    """uvicorn on ``sock`` until a signal, then the engine drained and stopped."""
    import asyncio  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415

    server = _uvicorn_server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=None))
    aeng.start()
    try:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            print(banner, flush=True)
        await serving
    finally:
        await aeng.shutdown(drain=not server.force_exit)


def _uvicorn_server(config):
    """A ``uvicorn.Server`` that drains on SIGINT and SIGTERM and then returns. uvicorn's own
    re-raises the signal after its graceful shutdown (the process would end with 130);
    Ctrl-C is how a server is stopped, so here the command exits 0."""
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)
