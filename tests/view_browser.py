"""A headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by selenium)
on a ``blockformer view`` served in a thread, for the browser tests and docs/screenshots.py."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"


def find_browser() -> tuple[str, str] | None:
    """(browser, driver) paths, or None when either is missing."""
    browser = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    driver = shutil.which(DRIVER)
    return (browser, driver) if browser and driver else None


class Served:
    """An app (default: ``create_app(root, server)``, the view) under uvicorn on a free port
    of 127.0.0.1, in a daemon thread."""

    def __init__(self, root: Path | None = None, server: str | None = None, app: Any = None) -> None:
        import uvicorn

        from blockformer.view import create_app

        app = app if app is not None else create_app(root, server)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("blockformer view did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def serve_checkpoint(path: Path) -> tuple[Any, Served]:
    """``blockformer serve``'s engine and app over a checkpoint, as the command builds them:
    (the started AsyncEngine, the Served app; its ``url`` has no trailing slash)."""
    from blockformer.serve.api import build_app
    from blockformer.serve.async_engine import AsyncEngine
    from blockformer.serve.engine import Engine

    aeng = AsyncEngine(Engine.from_checkpoint(path, num_blocks=64))
    aeng.start()
    served = Served(app=build_app(aeng, model_name="tiny"))
    served.url = served.url.rstrip("/")
    return aeng, served


def stop_serving(aeng: Any, served: Served) -> None:
    import asyncio

    served.stop()
    asyncio.run(aeng.shutdown(drain=False, timeout=10))


def start_browser(browser: str, driver: str, width: int = 1400, height: int = 1000) -> Any:
    """A headless Chromium that keeps its console log and its network events."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last call (warnings and info are not errors)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def requested_urls(driver: Any) -> list[str]:
    """Every URL the page asked the network for since the last call (DevTools' log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def wait_for(driver: Any, script: str, timeout: float = 20.0) -> Any:
    """Poll a JavaScript expression until it is truthy; return its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {script}")
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"page never satisfied: {script}")
        time.sleep(0.1)
