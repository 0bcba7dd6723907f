"""``blockformer view``: its JSON API against the files and the model it reads.

The attention weights are checked against the attention kernel itself: ``sdpa``, the one
function every attention module calls, is wrapped to record the q, k, mask and scale it was
given in the very forward the page's answer came from, and torch's
``scaled_dot_product_attention`` of those with ``v = I`` is the weight matrix it computed.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fastapi")
pytest.importorskip("plotly")
from fastapi.testclient import TestClient  # noqa: E402

from blockformer.cli import main  # noqa: E402
from blockformer.generate import generate  # noqa: E402
from blockformer.nn import attention as attention_module  # noqa: E402
from blockformer.train.load import load_checkpoint  # noqa: E402
from blockformer.train.metrics import read_metrics  # noqa: E402
from blockformer.view import create_app, export  # noqa: E402
from blockformer.view.app import plotly_js  # noqa: E402
from view_runs import SHORT, make_runs, records, root, write_run  # noqa: E402,F401 - root: a fixture

TEXT = SHORT


@pytest.fixture(scope="module")
def client(root):
    return TestClient(create_app(root))


# ---------------------------------------------------------------------- runs
def test_runs_listing_names_each_run_with_its_last_records_and_checkpoints(client):
    runs = {r["name"]: r for r in client.get("/api/runs").json()["runs"]}
    assert set(runs) == {"dec", "s2s", "enc", "plain"}
    assert runs["dec"]["last_train"]["step"] == 20 and runs["dec"]["last_val"]["val_loss"] == pytest.approx(4.2 / 20)
    assert runs["dec"]["checkpoints"] == ["best", "step-000010"] and runs["plain"]["checkpoints"] == []
    assert runs["s2s"]["model"]["arch"] == "encoder-decoder"


def test_metrics_columns_equal_the_values_of_metrics_jsonl(client, root):
    columns = client.get("/api/metrics", params={"run": "dec"}).json()["columns"]
    for split in ("train", "val"):
        expected = [r for r in read_metrics(root / "dec") if r["split"] == split]
        keys = set().union(*expected)
        assert set(columns[split]) == keys
        for key in keys:
            assert columns[split][key] == [r.get(key) for r in expected], (split, key)


def test_the_cursor_reads_only_new_lines_and_leaves_a_half_written_one_for_later(tmp_path):
    run = write_run(tmp_path / "r", None, records(3))
    (run / ".lock").write_text("{}")  # a trainer is writing
    client = TestClient(create_app(tmp_path))
    first = client.get("/api/metrics", params={"run": "r"}).json()
    assert first["columns"]["train"]["step"] == [1, 2, 3]
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"split": "train", "step": 4, "loss": 0.5}) + "\n" + '{"split": "train", "st')
    second = client.get("/api/metrics", params={"run": "r", "cursor": first["cursor"]}).json()
    assert second["columns"]["train"]["step"] == [4] and second["partial"] and second["warnings"] == []
    with open(run / "metrics.jsonl", "a") as f:
        f.write('ep": 5, "loss": 0.25}\n')
    third = client.get("/api/metrics", params={"run": "r", "cursor": second["cursor"]}).json()
    assert third["columns"]["train"]["loss"] == [0.25] and not third["partial"] and not third["reset"]


def test_a_replaced_metrics_file_is_read_again_from_its_start(tmp_path):
    run = write_run(tmp_path / "r", None, records(6))
    client = TestClient(create_app(tmp_path))
    cursor = client.get("/api/metrics", params={"run": "r"}).json()["cursor"]
    tmp = run / "new.jsonl"
    tmp.write_text(json.dumps({"split": "train", "step": 1, "loss": 9.0}) + "\n")
    tmp.replace(run / "metrics.jsonl")  # what a resumed run does
    answer = client.get("/api/metrics", params={"run": "r", "cursor": cursor}).json()
    assert answer["reset"] and answer["columns"]["train"]["loss"] == [9.0]


def test_a_corrupt_line_and_a_torn_last_line_of_a_finished_run_are_named_not_raised(tmp_path):
    run = write_run(tmp_path / "r", None, records(2))
    with open(run / "metrics.jsonl", "a") as f:
        f.write("not json\n" + json.dumps({"split": "train", "step": 3, "loss": 1.0}) + "\n" + '{"spl')
    answer = TestClient(create_app(tmp_path)).get("/api/metrics", params={"run": "r"}).json()
    assert answer["columns"]["train"]["step"] == [1, 2, 3]
    assert answer["warnings"] == ["metrics.jsonl: line 3 is not a metrics record; skipped",
                                  "metrics.jsonl: line 5 is cut short (an interrupted write?); ignored"]


def test_an_empty_runs_folder_says_so_and_an_unknown_run_is_a_404(tmp_path):
    client = TestClient(create_app(tmp_path))
    listing = client.get("/api/runs").json()
    assert listing["runs"] == [] and "no runs here yet" in listing["message"]
    answer = client.get("/api/metrics", params={"run": "../etc"})
    assert answer.status_code == 404 and answer.json()["error"] == f"run '../etc': not found under {tmp_path}"
    assert client.get("/api/checkpoints").json() == []


def test_a_config_that_cannot_be_read_is_named_on_the_run(tmp_path):
    run = write_run(tmp_path / "r", None, records(1))
    (run / "config.toml").write_text("[model\n")
    client = TestClient(create_app(tmp_path))
    assert client.get("/api/runs").json()["runs"][0]["problem"].startswith("config.toml: cannot be read")
    assert client.get("/api/diff", params={"a": "r", "b": "r"}).status_code == 400


def test_config_diff_lists_exactly_the_keys_that_differ(client):
    diff = {d["key"]: (d["a"], d["b"]) for d in client.get("/api/diff", params={"a": "dec", "b": "s2s"}).json()["diff"]}
    assert diff["model.arch"] == ("decoder", "encoder-decoder")
    assert diff["train.lr"] == (1e-3, 3e-4)
    assert "model.vocab_size" not in diff and "data.tokenizer" not in diff


# ---------------------------------------------------------------------- attention
def kernel_weights(monkeypatch) -> list[torch.Tensor]:
    """Wrap the attention kernel; each call appends its weights (H, Tq, Tk), computed by
    torch's scaled_dot_product_attention with v = I from the q, k, mask and scale it got."""
    seen: list[torch.Tensor] = []
    real = attention_module.sdpa

    def spy(q, k, v, mask, is_causal, dropout, scale=None, kv_scales=None):
        groups = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(groups, dim=1).double()
        eye = torch.eye(k.shape[-2], dtype=torch.float64).expand(*kk.shape[:2], -1, -1)
        m = mask if mask is None or mask.dtype == torch.bool else mask.double()
        seen.append(F.scaled_dot_product_attention(q.double(), kk, eye, attn_mask=m, is_causal=is_causal,
                                                   scale=scale)[0])
        return real(q, k, v, mask, is_causal, dropout, scale, kv_scales)

    monkeypatch.setattr(attention_module, "sdpa", spy)
    return seen


@pytest.mark.parametrize("run, kinds", [
    ("dec", ["causal", "causal"]),
    ("s2s", ["bidirectional", "causal", "cross"]),
    ("enc", ["bidirectional"]),
])
def test_attention_weights_equal_the_kernels_own_probabilities(client, monkeypatch, run, kinds):
    seen = kernel_weights(monkeypatch)
    answer = client.post("/api/attention", json={"checkpoint": f"{run}/best", "text": TEXT, "target": "a dog"}).json()
    layers = answer["layers"]
    assert [layer["kind"] for layer in layers] == kinds and len(seen) == len(layers)
    for layer, reference in zip(layers, seen):
        weights = torch.tensor(layer["weights"], dtype=torch.float64)
        assert weights.shape == reference.shape == (answer["n_heads"], len(layer["queries"]), len(layer["keys"]))
        torch.testing.assert_close(weights, reference, atol=1e-5, rtol=0)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2], dtype=torch.float64), atol=1e-5,
                                   rtol=0)
        if layer["kind"] == "causal":
            assert weights.triu(1).abs().max() == 0
    if run == "s2s":
        assert layers[2]["queries"] == ["<s>", "a", " ", "d", "o", "g"] and layers[2]["keys"] == list(TEXT)


@pytest.mark.parametrize("body, status, message", [
    ({"text": "the cat ¿qué?"}, 400, "text: 5 character(s) outside the tokenizer's vocabulary ('?', 'q', 'u', '¿', 'é')"),
    ({"text": "a" * 65}, 400, "text: 65 tokens; expected at most 64 (the model's max_seq_len); shorten it"),
    ({"text": "a" * 100_000}, 400, "text: 100,000 characters; expected at most 20,000 (shorten it)"),
    ({"text": ""}, 400, "text: encodes to no tokens; expected some text"),
    ({"text": 5}, 400, "text: expected a string"),
    ({"text": "a", "checkpoint": "dec/step-000099"}, 404, "checkpoint 'dec/step-000099': not found"),
    ({"text": "a", "checkpoint": "plain"}, 400, "checkpoint 'plain': expected one from the list"),
])
def test_attention_refuses_bad_input_with_one_clear_line(client, body, status, message):
    answer = client.post("/api/attention", json={"checkpoint": "dec/best", **body})
    assert answer.status_code == status and answer.json()["error"].startswith(message)


def test_a_checkpoint_of_another_architecture_is_a_clear_400(tmp_path):
    write_run(tmp_path / "r", None, records(1))
    make_runs(tmp_path / "more")
    ckpt = tmp_path / "more" / "dec" / "step-000010"
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["arch"] = "mamba"
    (ckpt / "config.json").write_text(json.dumps(config))
    answer = TestClient(create_app(tmp_path)).post("/api/attention", json={"checkpoint": "more/dec/best", "text": "a"})
    assert answer.status_code == 400
    assert answer.json()["error"] == (f"{ckpt}: cannot be loaded (TransformerConfig.arch='mamba': expected one of "
                                      "'encoder', 'decoder', 'encoder-decoder'); expected a checkpoint written by "
                                      "`blockformer train`")


# ---------------------------------------------------------------------- next token, playground
def test_next_tokens_are_the_top_k_of_the_models_softmax(client, root):
    answer = client.post("/api/next", json={"checkpoint": "dec/best", "text": "the cat", "k": 3}).json()
    ckpt = load_checkpoint(root / "dec" / "best")
    ids = ckpt.tokenizer.encode("the cat")
    with torch.no_grad():
        probs = ckpt.model(torch.tensor([ids]))[0].softmax(-1)
    for t, position in enumerate(answer["positions"]):
        top = probs[t].topk(3)
        assert [c["id"] for c in position["top"]] == top.indices.tolist()
        assert [c["prob"] for c in position["top"]] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert answer["positions"][0]["next_actual"] == pytest.approx(float(probs[0, ids[1]]), abs=1e-6)
    refused = client.post("/api/next", json={"checkpoint": "enc/best", "text": "the"})
    assert refused.status_code == 400 and "expected a decoder language model" in refused.json()["error"]


def test_the_playground_streams_generates_greedy_tokens_with_their_probabilities(client, root):
    answer = client.post("/api/generate", json={"checkpoint": "dec/best", "prompt": "the ", "max_new_tokens": 12,
                                                "temperature": 0})
    items = [json.loads(line) for line in answer.text.splitlines()]
    ckpt = load_checkpoint(root / "dec" / "best")
    prompt = ckpt.tokenizer.encode("the ")
    expected = generate(ckpt.model, [prompt], 12, do_sample=False, eos_id=ckpt.tokenizer.eos_id)[0]
    assert [i["id"] for i in items] == expected
    with torch.no_grad():
        probs = ckpt.model(torch.tensor([prompt + expected[:-1]]))[0].softmax(-1)
    reference = [float(probs[len(prompt) - 1 + n, t]) for n, t in enumerate(expected)]
    assert [i["prob"] for i in items] == pytest.approx(reference, abs=1e-5)
    bad = client.post("/api/generate", json={"checkpoint": "dec/best", "prompt": "the", "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"] == "temperature: -1.0; expected a number from 0.0 to 10.0"


# ---------------------------------------------------------------------- assets, export, command line
def test_pages_load_nothing_from_outside_and_plotly_comes_from_its_package(client):
    for path in ("/", "/attention", "/next", "/playground"):
        html = client.get(path).text
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), path
    assert client.get("/assets/plotly.min.js").content == plotly_js().read_bytes()


def test_the_static_export_inlines_the_data_and_copies_plotly(root, tmp_path):
    pages = export(root, tmp_path / "site", "dec/best", TEXT)
    assert [p.name for p in pages] == ["index.html", "attention.html"]
    assert (tmp_path / "site" / "assets" / "plotly.min.js").read_bytes() == plotly_js().read_bytes()
    data = json.loads(re.search(r"window.BLOCKFORMER_STATIC = (.*?);</script>", pages[0].read_text()).group(1))
    assert data["metrics"]["dec"]["train"]["loss"] == [r["loss"] for r in read_metrics(root / "dec")
                                                       if r["split"] == "train"]
    attention = json.loads(re.search(r"window.BLOCKFORMER_STATIC = (.*?);</script>", pages[1].read_text()).group(1))
    assert attention["attention"]["tokens"] == list(TEXT) and len(attention["attention"]["layers"]) == 2


def test_cli_view_exports_and_refuses_a_missing_folder(root, tmp_path, capsys):
    assert main(["view", str(tmp_path / "nowhere")]) == 2
    assert "runs directory not found" in capsys.readouterr().err
    assert main(["view", str(root), "--export", str(tmp_path / "out"), "--text", "¿"]) == 0
    assert "outside the tokenizer" in (tmp_path / "out" / "attention.html").read_text()


# ---------------------------------------------------------------------- a running `blockformer serve`
def test_latency_quantiles_interpolate_within_a_bucket_as_promql_does():
    from blockformer.view.server import quantile

    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 10.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)  # rank 5 of 10, in (0.1, 0.5]
    assert quantile(0.99, buckets) == 1.0  # past the last finite bound
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


@pytest.fixture(scope="module")
def serving(root):
    pytest.importorskip("prometheus_client")
    from view_browser import serve_checkpoint, stop_serving

    aeng, served = serve_checkpoint(root / "dec" / "best")
    yield served
    stop_serving(aeng, served)


def test_the_playground_through_the_server_streams_generates_greedy_text(root, serving):
    client = TestClient(create_app(root, serving.url))
    answer = client.post("/api/generate", json={"via": "server", "prompt": "the ", "max_new_tokens": 12,
                                                "temperature": 0})
    items = [json.loads(line) for line in answer.text.splitlines()]
    ckpt = load_checkpoint(root / "dec" / "best")
    prompt = ckpt.tokenizer.encode("the ")
    expected = generate(ckpt.model, [prompt], 12, do_sample=False, eos_id=ckpt.tokenizer.eos_id)[0]
    assert "".join(i["token"] for i in items) == ckpt.tokenizer.decode(expected)
    with torch.no_grad():
        probs = ckpt.model(torch.tensor([prompt + expected[:-1]]))[0].softmax(-1)
    reference = [float(probs[len(prompt) - 1 + n, t]) for n, t in enumerate(expected)]
    assert [i["prob"] for i in items] == pytest.approx(reference, abs=1e-4)


def test_the_server_page_reads_the_servers_metrics(root, serving):
    client = TestClient(create_app(root, serving.url))
    client.post("/api/generate", json={"via": "server", "prompt": "the ", "max_new_tokens": 5, "temperature": 0})
    status = client.get("/api/server").json()
    assert status["model"] == "tiny" and status["requests_finished"] >= 1
    assert status["gauges"]["kv_blocks_total"] == 64 and status["gauges"]["requests_running"] == 0
    assert status["latency"]["e2e_request_latency_seconds"]["count"] >= 1
    assert status["latency"]["e2e_request_latency_seconds"]["p50"] > 0


def test_a_server_that_does_not_answer_is_a_clear_503_and_no_server_a_404(root, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = TestClient(create_app(root, url))
    answer = client.get("/api/server")
    assert answer.status_code == 503 and answer.json()["error"].startswith(f"the server at {url} does not answer")
    answer = client.post("/api/generate", json={"via": "server", "prompt": "the"})
    assert answer.status_code == 503
    plain = TestClient(create_app(root))
    assert plain.get("/api/server").status_code == 404
    assert plain.post("/api/generate", json={"via": "server", "prompt": "a"}).json()["error"] == \
        "via server: the view was started without --server URL"


def test_cli_view_names_a_port_in_use_in_one_line(root, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["view", str(root), "--port", str(port)]) == 2
    assert f"--port {port}: cannot listen there (Address already in use)" in capsys.readouterr().err


# ---------------------------------------------------------------------- probes
def test_the_probes_page_runs_a_probe_as_the_command_does(client):
    from blockformer.probes import run_probe

    listed = {p["name"]: p for p in client.get("/api/probes").json()}
    assert listed["equivariance"]["options"][0] == {"name": "seq_len", "default": 8, "type": "int"}
    answer = client.post("/api/probe", json={"name": "toy", "options": {"dtype": "float64"}}).json()
    expected = run_probe("toy", dtype="float64").to_dict()
    assert answer["columns"] == expected["columns"] and answer["rows"] == expected["rows"]
    assert answer["plot"].startswith("data:image/png;base64,")
    named = client.post("/api/probe", json={"name": "attention", "options": {"checkpoint": "dec/best", "text": "the"}})
    assert named.json()["rows"][0][0] == "decoder.blocks.0.attn"
    for options, message in [({"seq_len": "x"}, "seq_len: 'x'; expected an integer"),
                             ({"nope": 1}, "probe equivariance: no option 'nope'; expected one of seq_len")]:
        refused = client.post("/api/probe", json={"name": "equivariance", "options": options})
        assert refused.status_code == 400 and refused.json()["error"].startswith(message)
