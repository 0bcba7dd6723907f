"""The HTTP layer of ``blockformer serve``: OpenAI's routes over the real engine.

A tiny random byte-level decoder is served twice: through FastAPI's ``TestClient`` for the
error paths, and by uvicorn on 127.0.0.1 for the ``openai`` client, streaming, disconnects
and the command line. Greedy text through the server equals ``blockformer.generate`` on
the same prompt; every refusal is a JSON error naming its field, with OpenAI's status.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
try:
    import httpx2 as httpx  # the name this environment's openai and starlette use
except ImportError:  # pragma: no cover
    httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from blockformer import build_model  # noqa: E402
from blockformer.cli import main  # noqa: E402
from blockformer.generate import generate, translate  # noqa: E402
from blockformer.run_config import load_run_config  # noqa: E402
from blockformer.serve.api import build_app  # noqa: E402
from blockformer.serve.async_engine import AsyncEngine  # noqa: E402
from blockformer.serve.engine import Engine  # noqa: E402
from blockformer.serve.params import SamplingParams  # noqa: E402
from blockformer.tokenizers import EOS_ID, CharTokenizer, train_tokenizer  # noqa: E402
from blockformer.train.checkpoint import save_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 4096  # long enough that a request held open for a test cannot finish meanwhile
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = "def f"  # the random model continues it with varied bytes and no EOS for 20 tokens
WAIT = 20.0  # seconds: the bound of every wait on the server or the engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random byte-level decoder (seed 0, init_std 0.2 so greedy choices vary), saved."""
    cfg = load_run_config(overrides=["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=256",
                                     "model.vocab_size=260", "model.init_std=0.2", "model.tie_embeddings=false",
                                     f"model.max_seq_len={CONTEXT}"])
    model = build_model(cfg.model, seed=0).eval()
    tok = train_tokenizer("byte", [])
    path = save_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", model, tok, cfg)
    return path, model, tok


def _engine(path, **options) -> AsyncEngine:
    aeng = AsyncEngine(Engine.from_checkpoint(path, num_blocks=640, **options))
    aeng.start()
    return aeng


def _shutdown(aeng: AsyncEngine) -> None:
    asyncio.run(aeng.shutdown(drain=False, timeout=WAIT))


def _wait_for(condition, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


class Served:
    """An app on uvicorn in a thread, on an ephemeral port of 127.0.0.1."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        _wait_for(lambda: self.server.started or not self.thread.is_alive(), "uvicorn to start")
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def aeng(tiny):
    aeng = _engine(tiny[0])
    yield aeng
    _shutdown(aeng)


@pytest.fixture(scope="module")
def served(aeng):
    served = Served(build_app(aeng, model_name="tiny", chat_template=TEMPLATE))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=WAIT)


@pytest.fixture(scope="module")
def plain(aeng):
    """The same engine behind an app without a chat template, in process."""
    return TestClient(build_app(aeng, model_name="tiny"), raise_server_exceptions=False)


def _greedy(tiny, prompt_ids: list[int], n: int) -> str:
    _, model, tok = tiny
    [ids] = generate(model, [prompt_ids], n, temperature=0, eos_id=EOS_ID)
    assert len(ids) == n, "the reference hit EOS: pick a prompt the random model continues"
    return tok.decode(ids)


# --- what a client gets ---


def test_completion_greedy_text_and_usage_equal_the_library_generate(tiny, client):
    tok = tiny[2]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    [choice] = out.choices
    assert choice.text == _greedy(tiny, tok.encode(PROMPT), 20)
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 20, 25)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # 5 tokens: less than one 16-token block


def test_streamed_completion_joins_to_the_same_text_then_usage_then_done(tiny, client):
    tok = tiny[2]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == 5
    pieces = chunks[:-1]
    assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert "".join(c.choices[0].text for c in pieces) == _greedy(tiny, tok.encode(PROMPT), 20)
    assert len({c.id for c in chunks}) == 1


def test_a_repeated_prompt_reports_its_prefix_cache_hit_in_usage(client):
    prompt = "the same forty characters, said again..."  # 40 tokens: two full 16-token blocks
    first, second = (client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
                     for _ in range(2))
    assert first.choices[0].text == second.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.usage.prompt_tokens == 40


def test_token_id_prompt_gives_the_text_prompts_completion(tiny, client):
    tok = tiny[2]
    out = client.completions.create(model="tiny", prompt=tok.encode(PROMPT), max_tokens=12, temperature=0)
    assert out.choices[0].text == _greedy(tiny, tok.encode(PROMPT), 12)


def test_chat_renders_the_template_and_answers_greedy_as_the_library(tiny, client):
    tok = tiny[2]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f"}]
    prompt = "system: be brief\nuser: def f\nassistant:"
    expected = _greedy(tiny, tok.encode(prompt), 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(tok.encode(prompt)), 10)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_greedy_logprobs_name_the_most_likely_token_in_both_styles(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()), abs=1e-5)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_models_health_and_a_seeded_sample_repeat(client, served):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(served.url + "/health", timeout=WAIT).json() == {"status": "ok"}
    a, b = (client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_metrics_parse_and_their_counters_rise_after_a_request(client, served):
    def scrape() -> dict[str, float]:
        text = httpx.get(served.url + "/metrics", timeout=WAIT).text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, temperature=0)
    after = scrape()
    for name in ["blockformer_requests_waiting{}", "blockformer_requests_running{}", "blockformer_kv_blocks_used{}",
                 "blockformer_kv_blocks_free{}", "blockformer_prefix_cache_hit_rate{}",
                 "blockformer_e2e_request_latency_seconds_count{}"]:
        assert name in after, name
    rise = {k: after[k] - before.get(k, 0) for k in after}
    assert rise["blockformer_generation_tokens_total{}"] == 7
    assert rise["blockformer_prompt_tokens_total{}"] == 5
    assert rise['blockformer_requests_total{"finish_reason": "length"}'] == 1
    assert rise["blockformer_time_to_first_token_seconds_count{}"] == 1
    assert rise["blockformer_time_per_output_token_seconds_count{}"] == 1
    assert after["blockformer_kv_blocks_used{}"] + after["blockformer_kv_blocks_free{}"] == 640


def test_a_streaming_client_that_disconnects_aborts_its_request_and_frees_its_blocks(aeng, served):
    generated = aeng.stats().generation_tokens_total
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=WAIT) as http:
        with http.stream("POST", served.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
            assert aeng.stats().blocks_used > 0  # the request holds its blocks while it runs
    _wait_for(lambda: aeng.stats().running == 0 and aeng.stats().blocks_used == 0, "the aborted request's blocks")
    assert aeng.stats().generation_tokens_total - generated < 4000  # aborted, not run to the end


def test_a_client_that_gives_up_on_a_plain_request_aborts_it_too(aeng, served):
    generated = aeng.stats().generation_tokens_total
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(WAIT, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(served.url + "/v1/completions", json=body)
    _wait_for(lambda: aeng.stats().running == 0 and aeng.stats().blocks_used == 0, "the abandoned request's blocks")
    assert aeng.stats().generation_tokens_total - generated < 4000


# --- errors: OpenAI's status and one message naming the field ---


def _error(response, status: int, param: str | None, *words: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    message = error["message"]
    assert "\n" not in message and "Traceback" not in message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("body, status, param, words", [
    ({"prompt": "a", "temperature": -1}, 400, "temperature", ["temperature: -1"]),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature", ["temperature", "number"]),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    ({"prompt": "a" * CONTEXT}, 400, "prompt", ["prompt", "context"]),
    ({"prompt": [5, 999]}, 400, "prompt", ["999", "vocabulary"]),
    ({"prompt": [1, "a"]}, 400, "prompt", ["string or a list of token ids"]),
    ({"prompt": "a", "model": "gpt-9"}, 404, "model", ["gpt-9", "tiny"]),
    ({"prompt": "a", "n": 2}, 400, "n", ["n: 2"]),
    ({"prompt": "a", "echo": True}, 400, "echo", ["echo"]),
    ({"prompt": "a", "tempreature": 1}, 400, "tempreature", ["unknown field", "temperature"]),
    ({"prompt": "a", "stop": ["x", 3]}, 400, "stop", ["stop"]),
    ({"temperature": 0}, 400, "prompt", ["prompt: missing"]),
    ({"prompt": "a", "logprobs": 99}, 400, "logprobs", ["logprobs"]),
])
def test_a_bad_completion_request_is_refused_naming_its_field(plain, body, status, param, words):
    _error(plain.post("/v1/completions", json=body), status, param, *words)


def test_bad_json_and_a_body_that_is_not_an_object_are_400(plain):
    bad = plain.post("/v1/completions", content=b'{"prompt": "a",', headers={"Content-Type": "application/json"})
    _error(bad, 400, None, "not valid JSON")
    _error(plain.post("/v1/completions", json=["a"]), 400, None, "request body", "JSON object")


def test_chat_without_a_template_is_400_naming_the_template(plain):
    response = plain.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    _error(response, 400, "messages", "chat template")


def test_chat_field_errors_name_the_field(plain, served):
    with httpx.Client(base_url=served.url, timeout=WAIT) as http:
        _error(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages", "empty")
        _error(http.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]}), 400,
               "messages[0].role", "missing")
        _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "top_logprobs": 2}), 400, "top_logprobs", "logprobs=true")


def test_a_template_that_refuses_the_messages_is_400_and_text_parts_are_joined(aeng, tiny):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}" \
             "{% endif %}" + TEMPLATE
    with TestClient(build_app(aeng, model_name="tiny", chat_template=strict)) as http:
        refused = http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "x"}]})
        _error(refused, 400, "messages", "must be the user's")
        parts = [{"type": "text", "text": "def"}, {"type": "text", "text": " f"}]
        out = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}],
                                                      "max_tokens": 5, "temperature": 0}).json()
        assert out["choices"][0]["message"]["content"] == _greedy(tiny, tiny[2].encode("user: def f\nassistant:"), 5)


def test_a_stopped_engine_is_503_on_health_and_refuses_requests(tiny):
    aeng = _engine(tiny[0])
    _shutdown(aeng)
    with TestClient(build_app(aeng, model_name="tiny")) as http:
        _error(http.get("/health"), 503, None, "not running")
        assert http.post("/v1/completions", json={"prompt": "a"}).status_code in (429, 503)


def test_embeddings_and_translations_on_a_decoder_are_400(plain):
    _error(plain.post("/v1/embeddings", json={"input": "a"}), 400, "model", "decoder", "encoder")
    _error(plain.post("/v1/translations", json={"input": "a"}), 400, "model", "decoder", "encoder-decoder")


def test_an_unknown_route_is_a_json_404(plain):
    _error(plain.get("/v2/nothing"), 404, None, "/v2/nothing", "/v1/completions")


def test_a_full_queue_is_429_with_retry_after(tiny):
    """One request runs and one waits (max_running=1, max_queued=1): the next is refused."""
    aeng = _engine(tiny[0], max_running=1, max_queued=1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def hold(prompt: str) -> None:
        async for _ in aeng.generate(prompt, SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0)):
            pass

    held = [asyncio.run_coroutine_threadsafe(hold("held one"), loop)]
    try:
        _wait_for(lambda: aeng.stats().running == 1, "the first request to run")
        held.append(asyncio.run_coroutine_threadsafe(hold("held two"), loop))
        _wait_for(lambda: aeng.stats().waiting == 1, "the second request to wait")
        with TestClient(build_app(aeng, model_name="tiny")) as http:
            response = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            _error(response, 429, None, "queue is full")
            assert int(response.headers["Retry-After"]) >= 1
    finally:
        for future in held:
            future.cancel()
        _wait_for(lambda: aeng.stats().blocks_used == 0 and aeng.stats().running == 0, "the held requests' abort")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT)
        _shutdown(aeng)


# --- the other kinds of model ---

SMALL = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32"]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    cfg = load_run_config(overrides=[*SMALL, "model.vocab_size=260", "model.arch=encoder"])
    path = save_checkpoint(tmp_path_factory.mktemp("enc") / "enc", build_model(cfg.model, seed=0),
                           train_tokenizer("byte", []), cfg)
    aeng = _engine(path)
    yield aeng
    _shutdown(aeng)


def test_embeddings_are_the_engines_vectors_as_floats_or_base64(encoder):
    expected, tokens = encoder.engine.embed(["hello", "hi"], "mean")
    with TestClient(build_app(encoder, model_name="enc")) as http:
        out = http.post("/v1/embeddings", json={"input": ["hello", "hi"], "model": "enc"}).json()
        assert [d["index"] for d in out["data"]] == [0, 1] and out["object"] == "list"
        for row, want in zip(out["data"], expected):
            assert row["embedding"] == pytest.approx(want, abs=1e-6)
        assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens} and tokens == 2 + 5 + 2 + 2
        packed = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}).json()
        raw = base64.b64decode(packed["data"][0]["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(expected[0], abs=1e-6)
        _error(http.post("/v1/embeddings", json={"input": "a", "pooling": "max"}), 400, "pooling", "'mean'")
        _error(http.post("/v1/embeddings", json={"input": []}), 400, "input", "empty")
        _error(http.post("/v1/completions", json={"prompt": "a"}), 400, "model", "encoder", "/v1/embeddings")


def test_translations_equal_the_library_translate_greedy_and_beam(tmp_path):
    tok = CharTokenizer("abcdefghij")
    cfg = load_run_config(preset="reverse", overrides=[*SMALL, f"model.vocab_size={tok.vocab_size}"])
    model = build_model(cfg.model, seed=0).eval()
    aeng = _engine(save_checkpoint(tmp_path / "ed", model, tok, cfg))
    try:
        sources = ["abc", "hgfedcb"]
        with TestClient(build_app(aeng, model_name="ed")) as http:
            for beam in (1, 3):
                want = translate(model, [tok.encode(s) + [EOS_ID] for s in sources], beam_size=beam, max_len=6)
                out = http.post("/v1/translations", json={"input": sources, "beam_size": beam, "max_tokens": 6})
                assert [d["text"] for d in out.json()["data"]] == [tok.decode(w) for w in want], beam
            _error(http.post("/v1/translations", json={"input": "abc", "beam_size": 0}), 400, "beam_size", "[1, 16]")
            _error(http.post("/v1/translations", json={"input": "a" * 100}), 400, "input", "context")
            _error(http.post("/v1/embeddings", json={"input": "a"}), 400, "model", "encoder-decoder")
    finally:
        _shutdown(aeng)


# --- the command ---


def _stream_events(url: str, body: dict, events: list[str]) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=WAIT) as response:
        events.extend(line for line in response.iter_lines() if line.startswith("data: "))


def test_serve_command_prints_a_working_curl_line_and_drains_on_sigint_then_exits_0(tiny):
    """Started as users start it; SIGINT arrives while a stream is half sent: the stream
    still ends with its finish reason and [DONE], and the command exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "blockformer", "serve", "--checkpoint", str(tiny[0]),
                             "--port", "0", "--num-blocks", "300", "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout.readline() for _ in range(2)), daemon=True)
        reader.start()
        reader.join(60)
        assert len(lines) == 2, (lines, proc.poll())
        url = lines[0].split(" at ")[1].strip()
        assert url.startswith("http://127.0.0.1:") and "tiny (decoder)" in lines[0]
        curl = lines[1].strip().removeprefix("try: ")
        assert curl.startswith(f"curl {url}/v1/completions") and '"model": "tiny"' in curl
        assert httpx.get(url + "/health", timeout=WAIT).json() == {"status": "ok"}
        if shutil.which("curl"):
            answer = json.loads(subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=WAIT).stdout)
            assert answer["usage"]["completion_tokens"] == 16
        events: list[str] = []
        streaming = threading.Thread(target=_stream_events, args=(url, {"prompt": "a", "max_tokens": 300,
                                                                     "ignore_eos": True}, events), daemon=True)
        streaming.start()
        _wait_for(lambda: len(events) >= 2, "the stream to start")
        proc.send_signal(signal.SIGINT)
        at_signal = len(events)
        out, err = proc.communicate(timeout=30)
        streaming.join(WAIT)
        assert len(events) > at_signal  # the stream went on after the signal
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_on_a_port_in_use_is_one_line_and_exit_2(tiny, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--checkpoint", str(tiny[0]), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--port {port}" in err and "in use" in err


@pytest.mark.parametrize("flags, named", [
    (["--port", "70000"], "--port 70000"),
    (["--max-running", "0"], "--max-running 0"),
    (["--chat-template", "/nonexistent/chat.jinja"], "/nonexistent/chat.jinja"),
    (["--host", "no.such.host.invalid"], "--host no.such.host.invalid"),
])
def test_serve_refuses_bad_flags_in_one_line_naming_them(tiny, flags, named, capsys):
    assert main(["serve", "--checkpoint", str(tiny[0]), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and named in err and "Traceback" not in err, err


def test_serve_has_help(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: blockformer serve" in out and "--max-num-batched-tokens" in out


def test_serve_refuses_a_bad_chat_template_file_in_one_line(tiny, tmp_path, capsys):
    bad = tmp_path / "chat.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    assert main(["serve", "--checkpoint", str(tiny[0]), "--chat-template", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--chat-template" in err and "line 1" in err


# --- load and faults ---


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status to read the RSS from")


async def _one(http, i: int) -> tuple[int, str, object]:
    """Request ``i`` of the load: its kind by ``i % 10``; returns (i, kind, what came back)."""
    kind = ["plain", "plain", "stream", "cancel", "plain", "bad_json", "stream", "cancel", "too_long", "bad_field"][i % 10]
    body = {"prompt": f"{i} def f", "max_tokens": 8 + i % 17, "temperature": 0 if i % 3 else 0.8, "seed": i}
    if kind == "bad_json":
        r = await http.post("/v1/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"})
        return i, kind, (r.status_code, r.json()["error"]["message"])
    if kind == "too_long":
        body["prompt"] = "x" * CONTEXT
    if kind == "bad_field":
        body["top_p"] = 0
    if kind in ("plain", "too_long", "bad_field"):
        r = await http.post("/v1/completions", json=body)
        return i, kind, (r.status_code, r.json())
    body |= {"stream": True, "max_tokens": 200 if kind == "cancel" else body["max_tokens"]}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if kind == "cancel" and len(events) == 2:
                    return i, kind, (r.status_code, events)  # leaving the block drops the connection
        return i, kind, (r.status_code, events)


def _check(i: int, kind: str, result) -> str | None:
    """The request's completion id (None for an error), after checking it is what ``kind``
    should get."""
    status, payload = result
    if kind in ("bad_json", "too_long", "bad_field"):
        assert status == 400, (i, kind, payload)
        return None
    assert status == 200, (i, kind, payload)
    if kind == "plain":
        assert payload["usage"]["completion_tokens"] >= 1
        return payload["id"]
    chunks = [json.loads(e) for e in payload if e != "[DONE]"]
    assert len({c["id"] for c in chunks}) == 1
    if kind == "stream":
        assert payload[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    return chunks[0]["id"]


def _aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=WAIT).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "blockformer_requests_total" and s.labels == {"finish_reason": "abort"})


@pytest.mark.slow
def test_200_requests_at_concurrency_32_with_faults_all_answered_once_and_nothing_leaks(tiny):
    aeng = _engine(tiny[0])
    served = Served(build_app(aeng, model_name="tiny"))

    async def wave(start: int, n: int) -> list:
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=served.url, timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            async def bounded(i):
                async with limit:
                    return await _one(http, i)
            return await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(start, start + n))), 80)

    try:
        asyncio.run(wave(1000, 20))  # warm-up: allocator pools, lazily imported modules
        rss, aborted_before = [_rss_mib()], _aborted(served.url)
        results = []
        for half in range(2):
            results += asyncio.run(wave(half * 100, 100))
            _wait_for(lambda: aeng.stats().running == 0 and aeng.stats().waiting == 0, "the engine to be idle")
            rss.append(_rss_mib())
        assert sorted(i for i, _, _ in results) == list(range(200))  # none lost, none twice
        ids = [_check(*r) for r in results]
        ids = [i for i in ids if i is not None]
        assert len(ids) == len(set(ids)) == 140  # 7 of every 10 kinds get an id; all different
        # the server saw the cancelled streams go: nearly all of their 40 requests aborted
        assert _aborted(served.url) - aborted_before >= 36
        _wait_for(lambda: aeng.stats().blocks_used == 0, "every request's blocks to be free")
        assert httpx.get(served.url + "/health", timeout=WAIT).json() == {"status": "ok"}
        print(f"RSS after the warm-up and the two halves: {rss} MiB")
        assert rss[2] - rss[1] < 32, f"RSS grew {rss} MiB over the two halves"
    finally:
        served.stop()
        _shutdown(aeng)
