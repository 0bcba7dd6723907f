"""What the server page and the playground ask of a running ``blockformer serve``.

The view talks to the server over its own HTTP API, as any client would: ``/metrics``
(Prometheus' text, read with ``prometheus_client``'s parser) for the queue, the running
batch, the KV blocks, tokens/s and the latency histograms; ``/v1/completions`` streamed
with ``logprobs`` for the playground. The browser only ever talks to the view, so the page
asks nothing of any other address. A server that stops answering is a one-line
``UsageError`` (``ServerGone``), which the pages show while they keep polling.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from ..errors import UsageError

TIMEOUT = 3.0  # seconds for /metrics and for the first byte of a completion
PREFIX = "blockformer_"
QUANTILES = (0.5, 0.9, 0.99)
GAUGES = ("requests_waiting", "requests_running", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free",
          "prefix_cache_hit_rate", "generation_tokens_per_second")
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds")


class ServerGone(UsageError):
    """The server does not answer (stopped, or never started)."""


class Server:
    """A ``blockformer serve`` at ``url`` (``http://127.0.0.1:8000``)."""

    def __init__(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--server {url!r}: expected the URL `blockformer serve` printed, http://HOST:PORT")
        self.url = url.rstrip("/")

    def _open(self, path: str, body: dict | None = None, timeout: float = TIMEOUT):
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise UsageError(f"the server at {self.url}: {_message(e)}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerGone(f"the server at {self.url} does not answer ({reason}); stopped? "
                             f"start it with `blockformer serve CHECKPOINT`") from None

    def model(self) -> str | None:
        """The name the server serves its model under."""
        with self._open("/v1/models") as answer:
            data = json.loads(answer.read())
        return (data.get("data") or [{}])[0].get("id")

    def status(self) -> dict[str, Any]:
        """The engine's gauges and the latency percentiles, from one scrape of ``/metrics``."""
        with self._open("/metrics") as answer:
            text = answer.read().decode("utf-8")
        return {"url": self.url, **summarise(text)}

    def complete(self, prompt: str, settings: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Stream a completion of ``prompt`` with ``settings`` (``checkpoints.sampling``'s):
        each token's text and probability as the server sends them (``logprobs``: the
        chosen token's log-probability under the model, temperature 1, as the local one)."""
        body = {"prompt": prompt, "stream": True, "logprobs": 1, "max_tokens": settings["max_new_tokens"],
                "temperature": settings["temperature"], "top_p": settings["top_p"] or 1.0,
                "top_k": settings["top_k"] or 0, "seed": settings["seed"]}
        answer = self._open("/v1/completions", body)
        return _events(answer, self.url)


def _events(answer, url: str) -> Iterator[dict[str, Any]]:
    try:
        for raw in answer:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if "error" in chunk:
                yield {"error": chunk["error"].get("message", str(chunk["error"]))}
                return
            for choice in chunk.get("choices", []):
                logprobs = choice.get("logprobs") or {}
                for token, lp in zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", [])):
                    yield {"id": None, "token": token, "prob": math.exp(lp) if lp is not None else None}
    except (OSError, ValueError) as e:
        yield {"error": f"the stream from the server at {url} was cut ({e}); stopped?"}
    finally:
        answer.close()


def _message(e: urllib.error.HTTPError) -> str:
    """The error an OpenAI-shaped answer carries, else the status."""
    try:
        error = json.loads(e.read()).get("error")
        return error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError, OSError):
        return f"HTTP {e.code}"


def summarise(text: str) -> dict[str, Any]:
    """Prometheus text -> the server page's numbers: each gauge, requests finished, and
    p50/p90/p99 of each latency histogram (linear within a bucket, as PromQL's
    ``histogram_quantile`` does)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise UsageError("the server page needs prometheus_client; pip install prometheus_client") from None
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    gauges = {g: _value(samples, PREFIX + g) for g in GAUGES}
    finished = sum(s.value for s in samples.get(PREFIX + "requests_total", []))
    latency = {}
    for h in HISTOGRAMS:
        buckets = sorted(((float(s.labels["le"]), s.value) for s in samples.get(f"{PREFIX}{h}_bucket", [])))
        count = _value(samples, f"{PREFIX}{h}_count") or 0
        latency[h] = {"count": count, **{f"p{round(q * 100)}": quantile(q, buckets) for q in QUANTILES}}
    return {"gauges": gauges, "requests_finished": finished, "latency": latency}


def _value(samples: dict[str, list], name: str) -> float | None:
    found = samples.get(name)
    return found[0].value if found else None


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a cumulative histogram ``[(upper bound, count), ...]``."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: that bound, as PromQL answers
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return lower
