"""``blockformer view --export DIR``: the runs and attention pages as files to share.

The pages are the app's own, with the answers their scripts would have fetched inlined
(``window.BLOCKFORMER_STATIC``), ``plotly.min.js`` copied from the installed plotly
package, and the hand-written scripts and styles beside them: ``DIR/index.html`` opens
from the file system with nothing fetched.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ..errors import UsageError
from . import checkpoints as ckpts
from .app import Runs, checkpoint_list, page, plotly_js, runs_listing, static_dir
from .runs import config_diff, read_config, read_new

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog."
MAX_DIFFED = 25  # the export holds the config diff of every pair of its first this-many runs


def export(root: str | Path, out: str | Path, checkpoint: str | None = None, text: str = DEFAULT_TEXT,
           target: str = "") -> list[Path]:
    """Write the static pages for the runs folder ``root`` into ``out``; return the pages.
    ``checkpoint`` (``<run>/<checkpoint>``, default: the first one found) and ``text`` are
    what the attention page shows; a text it cannot show becomes the page's message."""
    runs, out = Runs(Path(root)), Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: is a file; expected a directory for the exported pages")
    (out / "static").mkdir(parents=True, exist_ok=True)
    (out / "assets").mkdir(exist_ok=True)
    for file in static_dir().iterdir():
        if file.suffix in (".js", ".css"):
            shutil.copyfile(file, out / "static" / file.name)
    shutil.copyfile(plotly_js(), out / "assets" / "plotly.min.js")
    listed = checkpoint_list(runs)
    pages = [out / "index.html", out / "attention.html"]
    pages[0].write_text(page("runs.html", {**runs_data(runs), "checkpoints": listed}), encoding="utf-8")
    attention = attention_data(runs, listed, checkpoint, text, target)
    pages[1].write_text(page("attention.html", {**attention, "checkpoints": listed}), encoding="utf-8")
    return pages


def runs_data(runs: Runs) -> dict[str, Any]:
    """What the runs page fetches: the listing, every run's metrics and config, and the
    config diff of each pair."""
    listing = runs_listing(runs)
    found = runs.all()
    metrics = {r.name: read_new(r)["columns"] for r in found}
    configs = {r.name: read_config(r)[0] for r in found}
    readable = [name for name, config in configs.items() if config is not None][:MAX_DIFFED]
    diffs = {f"{a}\n{b}": config_diff(configs[a], configs[b]) for a in readable for b in readable if a != b}
    return {"runs": listing, "metrics": metrics, "configs": configs, "diffs": diffs}


def attention_data(runs: Runs, listed: list[dict[str, Any]], checkpoint: str | None, text: str,
                   target: str) -> dict[str, Any]:
    """The attention page's answer for one checkpoint and text, or the message why there is none."""
    if checkpoint is None:
        if not listed:
            return {"attention": None, "message": "no checkpoints under the runs folder"}
        checkpoint = listed[0]["name"]
    try:
        ckpt = ckpts.Checkpoints().get(runs.checkpoint(checkpoint))
        return {"attention": ckpts.attention(ckpt, text, target), "checkpoint": checkpoint, "text": text,
                "target": target}
    except (UsageError, LookupError) as e:
        return {"attention": None, "checkpoint": checkpoint, "text": text,
                "message": f"{checkpoint}: {e.args[0] if e.args else e}"}
