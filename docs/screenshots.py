"""Screenshots of ``blockformer view``'s pages for the README, taken in headless Chromium.

    python docs/screenshots.py RUNS_DIR --checkpoint RUN/best --text "ROMEO: ..." \
        [--seq2seq RUN/best --source abc --target cba] [--serve CKPT_DIR] [--out docs]

writes docs/view-runs.png, view-attention.png (and view-cross-attention.png), view-next.png
view-playground.png and view-probes.png (and, with --serve, view-server.png). It serves RUNS_DIR on 127.0.0.1 as ``blockformer view`` does and
drives Debian's ``chromium`` with selenium (tests/view_browser.py).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from view_browser import Served, find_browser, serve_checkpoint, start_browser, stop_serving, wait_for  # noqa: E402


def shoot(driver, url: str, ready: str, out: Path, click: str | None = None, height: int | None = None) -> None:
    """Open ``url``, wait for ``ready`` (after clicking ``click``), and save the page, as tall as it is."""
    driver.set_window_size(1400, 900)
    driver.get(url)
    wait_for(driver, ready, timeout=60)
    if click:
        driver.find_element("id", click).click()
        wait_for(driver, "window.viewState.done", timeout=60)
    time.sleep(1.0)  # plotly's transitions
    tall = height or driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, min(tall + 160, 2400))  # the window is taller than its viewport
    time.sleep(0.5)
    driver.save_screenshot(str(out))
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs_dir")
    parser.add_argument("--checkpoint", required=True, help="a decoder's RUN/CKPT, as the pages list it")
    parser.add_argument("--text", required=True)
    parser.add_argument("--seq2seq", help="an encoder-decoder's RUN/CKPT for the cross-attention picture")
    parser.add_argument("--source", default="")
    parser.add_argument("--target", default="")
    parser.add_argument("--serve", help="a decoder's checkpoint directory to serve for the server page")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args()
    found = find_browser()
    if found is None:
        sys.exit("screenshots: no chromium and chromedriver on PATH (apt-get install chromium chromium-driver)")
    out = Path(args.out)
    server, driver = Served(Path(args.runs_dir)), start_browser(*found)
    try:
        chart = "document.getElementById('chart-loss').data"
        shoot(driver, server.url, f"{chart} && {chart}.length > 0", out / "view-runs.png")
        query = urllib.parse.urlencode({"checkpoint": args.checkpoint, "text": args.text})
        shoot(driver, f"{server.url}attention?{query}", "window.viewState.answer", out / "view-attention.png",
              height=1500)
        if args.seq2seq:
            q = urllib.parse.urlencode({"checkpoint": args.seq2seq, "text": args.source, "target": args.target})
            driver.get(f"{server.url}attention?{q}")
            wait_for(driver, "window.viewState.answer", timeout=60)
            cross = driver.execute_script("return window.viewState.answer.layers.findIndex(l => l.kind === 'cross')")
            driver.execute_script(f"const m = document.getElementById('module'); m.value = '{cross}'; m.onchange();")
            driver.set_window_size(1400, 1300)
            time.sleep(1.0)
            driver.save_screenshot(str(out / "view-cross-attention.png"))
            print(out / "view-cross-attention.png")
        shoot(driver, f"{server.url}next?{query}", "window.viewState.answer", out / "view-next.png")
        play = urllib.parse.urlencode({"checkpoint": args.checkpoint, "prompt": args.text, "max_new_tokens": 200,
                                       "temperature": 0.8, "seed": 1})
        shoot(driver, f"{server.url}playground?{play}", "document.getElementById('checkpoint').value",
              out / "view-playground.png", click="go")
        shoot(driver, f"{server.url}probes?probe=toy", "window.viewState.probes.length", out / "view-probes.png",
              click="go")
        if args.serve:
            shoot_server(driver, args, out)
    finally:
        driver.quit()
        server.stop()


def shoot_server(driver, args, out: Path) -> None:
    """Serve ``args.serve``, send it a few completions through the playground, picture the server page."""
    aeng, engine = serve_checkpoint(Path(args.serve))
    view = Served(Path(args.runs_dir), engine.url)
    try:
        for seed in range(3):
            play = urllib.parse.urlencode({"via": "server", "prompt": args.text, "max_new_tokens": 30, "seed": seed})
            driver.get(f"{view.url}playground?{play}")
            wait_for(driver, "document.getElementById('via').value === 'server'")
            driver.find_element("id", "go").click()
            wait_for(driver, "window.viewState.done", timeout=60)
            error = driver.execute_script("return document.getElementById('message').textContent")
            if error:
                sys.exit(f"screenshots: the playground through the server: {error}")
        driver.get(f"{view.url}server")
        wait_for(driver, "window.viewState.status")
        time.sleep(4.5)  # two more reads for the charts
        driver.set_window_size(1400, 900)
        time.sleep(0.5)
        driver.save_screenshot(str(out / "view-server.png"))
        print(out / "view-server.png")
    finally:
        view.stop()
        stop_serving(aeng, engine)


if __name__ == "__main__":
    main()
