"""The web app: pages from the package's ``static/`` folder, plotly's JavaScript from the
installed ``plotly`` package, and a JSON API over ``runs.py`` and ``checkpoints.py``.

Every error a user can cause (an unknown run, text the tokenizer cannot spell, a damaged
checkpoint) is a 4xx answer ``{"error": "<one line>"}`` that the page shows; anything
else is a 500 with the same shape, and the app goes on serving.
"""

from __future__ import annotations

import json
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..train.run_dir import CONFIG_TOML
from . import checkpoints as ckpts
from . import probes
from .server import Server, ServerGone
from .runs import Run, checkpoints_of, config_diff, find_runs, read_config, read_new, summary

PAGES = {"/": "runs.html", "/attention": "attention.html", "/next": "next.html", "/playground": "playground.html",
         "/probes": "probes.html", "/server": "server.html"}
RUNS_TTL = 2.0  # seconds a listing of the runs folder is reused
DATA_MARK = "<!--DATA-->"  # where a static export puts its data into a page


def static_dir() -> Path:
    """The folder of the hand-written pages, scripts and styles (package data)."""
    return Path(str(resources.files("blockformer.view") / "static"))


def plotly_js() -> Path:
    """``plotly.min.js`` as the installed plotly package ships it."""
    try:
        import plotly
    except ImportError:
        raise UsageError("blockformer view needs plotly; pip install 'blockformer[view]'") from None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise UsageError(f"{path}: not found in the installed plotly package; reinstall plotly")
    return path


def page(name: str, data: dict[str, Any] | None = None) -> str:
    """A page's HTML; ``data`` (a static export's) is inlined as ``window.BLOCKFORMER_STATIC``."""
    html = (static_dir() / name).read_text(encoding="utf-8")
    script = ""
    if data is not None:
        text = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
        script = f"<script>window.BLOCKFORMER_STATIC = {text};</script>"
    return html.replace(DATA_MARK, script)


class Runs:
    """The runs folder, listed again when older than ``RUNS_TTL`` or asked for a name it lacks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[str, Run] = {}
        self._when = 0.0
        self._lock = threading.Lock()

    def all(self) -> list[Run]:
        with self._lock:
            if time.monotonic() - self._when > RUNS_TTL:
                self._runs = {r.name: r for r in find_runs(self.root)}
                self._when = time.monotonic()
            return list(self._runs.values())

    def get(self, name: str) -> Run:
        runs = {r.name: r for r in self.all()}
        if name not in runs:
            with self._lock:
                self._when = 0.0
            runs = {r.name: r for r in self.all()}
        if name not in runs:
            raise LookupError(f"run {name!r}: not found under {self.root}")
        return runs[name]

    def checkpoint(self, name: str) -> Path:
        """The path of a checkpoint named ``<run>/<checkpoint>`` as ``checkpoint_list`` gives it."""
        if not isinstance(name, str) or "/" not in name:
            raise UsageError(f"checkpoint {name!r}: expected one from the list, '<run>/<checkpoint>'")
        run_name, _, ckpt = name.rpartition("/")
        run = self.get(run_name)
        if ckpt not in checkpoints_of(run):
            raise LookupError(f"checkpoint {name!r}: not found (the run has {', '.join(checkpoints_of(run)) or 'none'})")
        return (run.path / ckpt).resolve()


def runs_listing(runs: Runs) -> dict[str, Any]:
    """The runs page's table: one summary per run, and a message when there is nothing to show."""
    found = runs.all()
    message = None if found else (f"{runs.root}: no runs here yet (a run directory holds metrics.jsonl or "
                                   f"config.toml; train one with `blockformer train --out {runs.root}/NAME`)")
    return {"root": str(runs.root), "runs": [summary(r) for r in found], "message": message}


def checkpoint_list(runs: Runs) -> list[dict[str, Any]]:
    """Every checkpoint of every run, with the run's architecture."""
    out = []
    for run in runs.all():
        info = summary(run)
        for ckpt in info["checkpoints"]:
            out.append({"name": f"{run.name}/{ckpt}", "run": run.name, "arch": info["model"].get("arch")})
    return out


def create_app(root: str | Path, server: str | None = None) -> Any:
    """The FastAPI app for the runs folder ``root``; ``server``: the URL of a running
    ``blockformer serve`` for the server page and the playground."""
    from fastapi import Body, FastAPI, Request
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
    from fastapi.staticfiles import StaticFiles

    runs, loaded = Runs(Path(root)), ckpts.Checkpoints()
    remote = Server(server) if server else None
    app = FastAPI(title="blockformer view", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=static_dir()), name="static")

    @app.exception_handler(UsageError)
    async def usage(request: Request, e: UsageError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=400)

    @app.exception_handler(ServerGone)
    async def gone(request: Request, e: ServerGone) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=503)

    @app.exception_handler(LookupError)
    async def missing(request: Request, e: LookupError) -> JSONResponse:
        return JSONResponse({"error": str(e.args[0]) if e.args else str(e)}, status_code=404)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        text = " ".join(str(e).split()) or type(e).__name__
        return JSONResponse({"error": f"internal error ({type(e).__name__}: {text[:300]})"}, status_code=500)

    for route, name in PAGES.items():
        app.add_api_route(route, (lambda name=name: HTMLResponse(page(name))), methods=["GET"],
                          include_in_schema=False)

    @app.get("/assets/plotly.min.js")
    def plotly() -> FileResponse:
        return FileResponse(plotly_js(), media_type="text/javascript")

    def fast_json(data: Any) -> Response:  # FastAPI's own encoder walks every value: slow for 10k-line runs
        return Response(json.dumps(data, allow_nan=False, separators=(",", ":")), media_type="application/json")

    @app.get("/api/runs")
    def list_runs() -> Response:
        return fast_json(runs_listing(runs))

    @app.get("/api/metrics")
    def metrics(run: str, cursor: str = "") -> Response:
        return fast_json(read_new(runs.get(run), cursor))

    @app.get("/api/config")
    def config(run: str) -> dict[str, Any]:
        found = runs.get(run)
        data, problem = read_config(found)
        try:
            text = (found.path / CONFIG_TOML).read_text(encoding="utf-8", errors="replace") if data else None
        except OSError:  # replaced or removed since: the parsed config is still shown
            text = None
        return {"run": run, "config": data, "problem": problem, "text": text}

    @app.get("/api/diff")
    def diff(a: str, b: str) -> dict[str, Any]:
        (ca, pa), (cb, pb) = read_config(runs.get(a)), read_config(runs.get(b))
        if ca is None or cb is None:
            raise UsageError(f"config diff: {a if ca is None else b}: {pa if ca is None else pb}")
        return {"a": a, "b": b, "diff": config_diff(ca, cb)}

    @app.get("/api/checkpoints")
    def checkpoints() -> list[dict[str, Any]]:
        return checkpoint_list(runs)

    @app.post("/api/attention")
    def attention(body: dict = Body(...)) -> Response:
        ckpt = loaded.get(runs.checkpoint(body.get("checkpoint")))
        return fast_json(ckpts.attention(ckpt, body.get("text", ""), body.get("target", "") or ""))

    @app.post("/api/next")
    def next_tokens(body: dict = Body(...)) -> dict[str, Any]:
        ckpt = loaded.get(runs.checkpoint(body.get("checkpoint")))
        return ckpts.next_tokens(ckpt, body.get("text", ""), body.get("k", 5))

    @app.post("/api/generate")
    def generate(body: dict = Body(...)) -> StreamingResponse:
        if body.get("via") == "server":
            if remote is None:
                raise UsageError("via server: the view was started without --server URL")
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str) or not prompt:
                raise UsageError("prompt: expected some text")
            tokens = remote.complete(prompt, ckpts.sampling(body))
        else:
            ckpt = loaded.get(runs.checkpoint(body.get("checkpoint")))
            tokens = ckpts.stream(ckpt, body.get("prompt", ""), body)  # checked here: a bad request is a 400
        lines = (json.dumps(t) + "\n" for t in tokens)
        return StreamingResponse(lines, media_type="application/x-ndjson")

    @app.get("/api/probes")
    def probe_list() -> list[dict[str, Any]]:
        return probes.probe_list()

    @app.post("/api/probe")
    def probe(body: dict = Body(...)) -> Response:
        name = body.get("name")
        named = {c["name"]: runs.checkpoint(c["name"]) for c in checkpoint_list(runs)}
        options = probes.options_of(name, body.get("options") or {}, named)
        return fast_json(probes.run(name, options))

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        return {"root": str(runs.root), "server": remote.url if remote else None}

    @app.get("/api/server")
    def server_status() -> dict[str, Any]:
        if remote is None:
            raise LookupError("no server: start the view with --server URL (the URL `blockformer serve` prints)")
        status = remote.status()
        try:
            status["model"] = remote.model()
        except UsageError:
            status["model"] = None
        return status

    return app
