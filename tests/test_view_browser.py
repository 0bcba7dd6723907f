"""``blockformer view`` in a real headless Chromium: each page loads with no console error
and asks nothing of any address but 127.0.0.1; the runs page draws the values of
``metrics.jsonl`` and follows a run as it grows; the attention page holds the API's
weights, with nothing above the diagonal of a causal module; the playground's greedy output
is ``generate``'s; a page whose server stopped says so; the static export opens from
``file://``. One browser and one server for the module. Skipped where no Chromium is
installed (``.ci/run`` installs Debian's)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("plotly")
pytest.importorskip("selenium")
from view_browser import Served, console_errors, find_browser, requested_urls, start_browser, wait_for  # noqa: E402
from view_runs import SHORT, make_runs, records, root, write_run  # noqa: E402,F401 - root: a fixture

from blockformer.generate import generate  # noqa: E402
from blockformer.train.load import load_checkpoint  # noqa: E402
from blockformer.train.metrics import read_metrics  # noqa: E402
from blockformer.view import export  # noqa: E402

FOUND = find_browser()
pytestmark = pytest.mark.skipif(FOUND is None, reason="no chromium and chromedriver on PATH (apt-get install "
                                                      "chromium chromium-driver)")
TEXT = SHORT


@pytest.fixture(scope="module")
def served(root):
    server = Served(root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    driver = start_browser(*FOUND)
    yield driver
    driver.quit()


def load(browser, url: str, ready: str) -> None:
    """Open ``url``, wait until ``ready`` holds, and check the console and the network."""
    console_errors(browser), requested_urls(browser)  # drop what earlier pages left
    browser.get(url)
    wait_for(browser, ready)
    assert console_errors(browser) == []
    outside = [u for u in requested_urls(browser) if not u.startswith(("http://127.0.0.1:", "data:", "file://"))]
    assert outside == []


def post(served, path: str, body: dict) -> dict:
    request = urllib.request.Request(served.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


CHART = "document.getElementById('chart-loss').data"


def drawn(browser) -> dict:
    """The loss chart's traces, by (run, split): (x, y)."""
    traces = browser.execute_script(f"return {CHART}.map(t => [t.meta.run, t.meta.split, t.x, t.y])")
    return {(run, split): (x, y) for run, split, x, y in traces}


def test_the_runs_page_draws_the_values_of_metrics_jsonl(browser, served, root):
    load(browser, served.url, f"{CHART} && {CHART}.length === 8")
    traces = drawn(browser)
    for run in ("dec", "s2s", "enc", "plain"):
        metrics = read_metrics(root / run)
        train = [r for r in metrics if r["split"] == "train"]
        val = [r for r in metrics if r["split"] == "val"]
        assert traces[run, "train"] == ([r["step"] for r in train], [r["loss"] for r in train])
        assert traces[run, "val"] == ([r["step"] for r in val], [r["val_loss"] for r in val])
    rows = browser.execute_script("return [...document.querySelectorAll('#runs tbody tr')].map(r => r.dataset.run)")
    assert rows == ["dec", "enc", "plain", "s2s"]


def test_the_runs_page_follows_a_run_that_is_still_written(browser, served, root):
    load(browser, served.url, f"{CHART} && {CHART}.length === 8")
    with open(root / "dec" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"split": "train", "step": 21, "loss": 0.125}) + "\n" + '{"split": "tr')
    wait_for(browser, f"{CHART}.some(t => t.meta.run === 'dec' && t.x.includes(21))", timeout=10)
    x, y = drawn(browser)["dec", "train"]
    assert x[-1] == 21 and y[-1] == 0.125 and len(x) == len(set(x))
    assert console_errors(browser) == []


def test_the_attention_page_holds_the_apis_weights_and_masks_the_future(browser, served):
    query = urllib.parse.urlencode({"checkpoint": "dec/best", "text": TEXT})
    load(browser, f"{served.url}attention?{query}", "window.viewState.answer && document.getElementById('heatmap-1-3')")
    shown = browser.execute_script("return window.viewState.answer")
    api = post(served, "api/attention", {"checkpoint": "dec/best", "text": TEXT})
    assert [layer["weights"] for layer in shown["layers"]] == [layer["weights"] for layer in api["layers"]]
    for i, layer in enumerate(api["layers"]):
        for h, weights in enumerate(layer["weights"]):
            z = browser.execute_script(f"return document.getElementById('heatmap-{i}-{h}').data[0].z")
            for q, row in enumerate(weights):
                assert z[q][: q + 1] == row[: q + 1] and all(v is None for v in z[q][q + 1:])
                assert sum(row) == pytest.approx(1.0, abs=1e-5) and all(v == 0 for v in row[q + 1:])
    lines = browser.execute_script("return [...document.querySelectorAll('#headview line')]"
                                   ".map(l => [+l.dataset.q, +l.dataset.k])")
    assert lines and all(k <= q for q, k in lines)  # the head view draws no line to a later key


def test_the_attention_page_names_text_the_tokenizer_cannot_spell(browser, served):
    query = urllib.parse.urlencode({"checkpoint": "dec/best", "text": "¿qué?"})
    browser.get(f"{served.url}attention?{query}")
    message = wait_for(browser, "document.querySelector('#message .error')?.textContent")
    assert message.startswith("text: 5 character(s) outside the tokenizer's vocabulary")
    assert all("status of 400" in e for e in console_errors(browser))  # the answer, not a script error


def test_the_playground_streams_generates_greedy_output(browser, served, root):
    query = urllib.parse.urlencode({"checkpoint": "dec/best", "prompt": "the ", "temperature": 0,
                                    "max_new_tokens": 10})
    load(browser, f"{served.url}playground?{query}", "document.getElementById('checkpoint').value === 'dec/best'")
    browser.find_element("id", "go").click()
    wait_for(browser, "window.viewState.done")
    ids = browser.execute_script("return window.viewState.tokens.map(t => t.id)")
    ckpt = load_checkpoint(root / "dec" / "best")
    assert ids == generate(ckpt.model, [ckpt.tokenizer.encode("the ")], 10, do_sample=False,
                           eos_id=ckpt.tokenizer.eos_id)[0]
    assert console_errors(browser) == []


def test_the_next_token_page_lists_the_apis_top_k(browser, served):
    query = urllib.parse.urlencode({"checkpoint": "dec/best", "text": "the cat", "k": 3})
    load(browser, f"{served.url}next?{query}", "window.viewState.answer")
    cells = browser.execute_script("return document.querySelectorAll('#next tbody tr').length")
    assert cells == len("the cat")
    api = post(served, "api/next", {"checkpoint": "dec/best", "text": "the cat", "k": 3})
    assert browser.execute_script("return window.viewState.answer.positions") == api["positions"]


def test_a_page_whose_server_stopped_says_so(browser, tmp_path):
    write_run(tmp_path / "r", None, records(6))
    server = Served(tmp_path)
    load(browser, server.url, f"{CHART} && {CHART}.length === 2")
    server.stop()
    message = wait_for(browser, "document.querySelector('#message .error')?.textContent", timeout=10)
    assert "does not answer (stopped?)" in message
    assert browser.execute_script(f"return {CHART}.length") == 2  # the curves stay


def test_the_static_export_opens_from_the_file_system(browser, root, tmp_path):
    pages = export(root, tmp_path / "site", "dec/best", TEXT)
    load(browser, pages[0].as_uri(), f"{CHART} && {CHART}.length === 8")
    metrics = [r for r in read_metrics(root / "plain") if r["split"] == "train"]
    assert drawn(browser)["plain", "train"] == ([r["step"] for r in metrics], [r["loss"] for r in metrics])
    load(browser, pages[1].as_uri(), "window.viewState.answer && document.getElementById('heatmap-0-0')")
    assert browser.execute_script("return window.viewState.answer.tokens") == list(TEXT)
    requested = browser.execute_script("return performance.getEntries().map(e => e.name)")
    assert all(u.startswith(("file://", "data:")) for u in requested if "://" in u or u.startswith("data:"))


def test_the_server_page_and_the_playground_through_it_say_when_the_server_stops(browser, root):
    pytest.importorskip("prometheus_client")
    from view_browser import serve_checkpoint, stop_serving

    aeng, engine = serve_checkpoint(root / "dec" / "best")
    view = Served(root, engine.url)
    try:
        query = urllib.parse.urlencode({"via": "server", "prompt": "the ", "temperature": 0, "max_new_tokens": 8})
        load(browser, f"{view.url}playground?{query}", "document.getElementById('via').value === 'server'")
        browser.find_element("id", "go").click()
        wait_for(browser, "window.viewState.done")
        text = browser.execute_script("return window.viewState.tokens.map(t => t.token).join('')")
        ckpt = load_checkpoint(root / "dec" / "best")
        assert text == ckpt.tokenizer.decode(generate(ckpt.model, [ckpt.tokenizer.encode("the ")], 8,
                                                      do_sample=False, eos_id=ckpt.tokenizer.eos_id)[0])
        load(browser, f"{view.url}server", "window.viewState.status")
        rows = browser.execute_script("return [...document.querySelectorAll('#gauges tr')]"
                                      ".map(r => [...r.cells].map(c => c.textContent))")
        assert ["KV blocks in the pool", "64"] in rows and ["requests running", "0"] in rows
        stop_serving(aeng, engine)
        message = wait_for(browser, "document.querySelector('#message .error')?.textContent", timeout=10)
        assert "does not answer" in message
        browser.find_element("css selector", "header a[href=playground]").click()
        wait_for(browser, "document.getElementById('via').options.length === 2")
        browser.execute_script("document.getElementById('via').value = 'server'")
        browser.find_element("id", "go").click()
        message = wait_for(browser, "document.querySelector('#message .error')?.textContent", timeout=10)
        assert "does not answer" in message
    finally:
        view.stop()
        if engine.thread.is_alive():
            stop_serving(aeng, engine)


def test_the_probes_page_shows_a_probes_table_and_plot(browser, served):
    load(browser, f"{served.url}probes?probe=toy", "window.viewState.probes.length")
    browser.find_element("id", "go").click()
    wait_for(browser, "window.viewState.done")
    assert console_errors(browser) == []
    rows = browser.execute_script("return document.querySelectorAll('#result table tbody tr').length")
    assert rows == len(browser.execute_script("return window.viewState.result.rows")) > 0
    assert browser.execute_script("return document.querySelector('#result img').naturalWidth") > 100
