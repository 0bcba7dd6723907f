"""Screenshots of ``blockformer view``'s pages for the README, taken in headless Chromium.

    python docs/screenshots.py RUNS_DIR --checkpoint RUN/best --text "ROMEO: ..." \
        [--seq2seq RUN/best --source abc --target cba] [--out docs]

writes docs/view-runs.png, view-attention.png (and view-cross-attention.png), view-next.png
and view-playground.png. It serves RUNS_DIR on 127.0.0.1 as ``blockformer view`` does and
drives Debian's ``chromium`` with selenium (tests/view_browser.py).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from view_browser import Served, find_browser, start_browser, wait_for  # noqa: E402


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
    finally:
        driver.quit()
        server.stop()


if __name__ == "__main__":
    main()
