"""Serving speed as vLLM's ``benchmark_serving`` measures it: one asyncio client streams
``POST /v1/completions`` at Poisson arrivals (fixed seed) at several request rates and a
saturating one (``inf``: all at once), fixed prompt and output lengths (``ignore_eos``),
tokens counted from the last chunk's ``usage``. On the same weights, each alone on the
machine: ``blockformer serve``, ``transformers serve --continuous-batching`` (the checkpoint
exported with ``to_hf``) and blockformer's one-request-at-a-time ``generate``.

    python benchmarks/bench_serve.py --model gpt2-small --rates 1,2,4,inf --num-requests 64 \\
        --concurrency 16 --out benchmarks/results/serve-gpt2-small.md
    python benchmarks/bench_serve.py --model demo --rates 1,2,4,inf --num-requests 64 \\
        --concurrency 16 --out benchmarks/results/serve-demo.md            # after `make demo`
    python benchmarks/bench_serve.py --server blockformer --prefix-test --num-requests 8 \\
        --out benchmarks/results/serve-prefix.md
    python benchmarks/bench_serve.py --shape 2,64,4 --num-requests 4 --rates inf --output-len 8   # smoke

The issue's reference (``transformers serve`` on a random GPT-2-small shape, 16 at once, a
32-word prompt, 32 new tokens, one thread each): 80.6 output tokens/s, TTFT 1.97 s, TPOT 141 ms.

TTFT runs from sending a request to its first content chunk, TPOT = (latency - TTFT) /
(completion_tokens - 1), ITL = the gaps between content chunks (pooled over requests); as in
vLLM, a request waiting for a ``--concurrency`` slot is timed from when it is sent.
``sequential`` has no server and no HTTP: the same prompts and schedule through
``blockformer.generate.generate``, one request at a time in arrival order, weights packed as
``blockformer generate`` packs them; a request counts as sent when it has arrived and a
concurrency slot is free, so its TTFT includes waiting for the requests ahead of it, as it
would behind a one-at-a-time server. The server (or ``generate``) runs on the first
``--threads`` cores with that many threads, the client on the next core, where there is one.

``transformers serve`` refuses ``ignore_eos`` (422): it gets ``generation_config`` with
``eos_token_id: -1`` instead, which turns its EOS check off; it ignores ``stream_options``
(it always sends ``usage``) and ends the stream without ``data: [DONE]``. It needs
``accelerate`` (in ``transformers[serving]``): ``pip install accelerate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    import httpx
except ImportError:
    import httpx2 as httpx  # what openai and huggingface_hub install here: httpx's API

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
SERVERS = ("blockformer", "transformers", "sequential")
SUFFIX_LEN = 8  # tokens after the shared prefix in --prefix-test


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=[*SERVERS, "all"], default="all")
    p.add_argument("--model", choices=["gpt2-small", "demo"], default="gpt2-small",
                   help="gpt2-small: random weights, 8000-token BPE; demo: runs/stdlib-lm (make demo)")
    p.add_argument("--checkpoint", type=Path, default=None, help="with --model demo: this run or checkpoint")
    p.add_argument("--shape", default="12,768,12", help="gpt2-small's layers,d_model,heads")
    p.add_argument("--rates", default="1,2,4,inf", help="request rates (req/s); inf: all at once")
    p.add_argument("--num-requests", type=int, default=64, help="per rate (per round in --prefix-test)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (of the model's tokenizer)")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens, with ignore_eos")
    p.add_argument("--concurrency", type=int, default=16, help="most requests in flight (0: no cap)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seeded per request")
    p.add_argument("--threads", type=int, default=1, help="server threads (OMP_NUM_THREADS / torch threads)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the weights' dtype in every server")
    p.add_argument("--prefix-test", action="store_true",
                   help="instead: TTFT of requests sharing a prefix, the first (miss) vs the rest (hits)")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to come up")
    p.add_argument("--blockformer-args", default="", help="e.g. --blockformer-args='--max-running 32'")
    p.add_argument("--transformers-args", default="", help="e.g. --transformers-args='--cb-num-blocks 512'")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "blockformer-bench-serve",
                   help="the random checkpoint, the exports and the server logs")
    p.add_argument("--out", type=Path, default=None, help="also write the report to this markdown file")
    return p.parse_args()


# ---------------------------------------------------------------------- machine and weights
def cpu_kind() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = info.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown CPU")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no avx2'}; {os.cpu_count()} cores)"


def split_cores(threads: int) -> tuple[set[int] | None, set[int] | None]:
    """(the server's cores, the client's core), or (None, None) where there are too few."""
    cores = sorted(os.sched_getaffinity(0))
    return (set(cores[:threads]), {cores[threads]}) if len(cores) > threads else (None, None)


def corpus_text() -> str:
    """tinyshakespeare where the shared data has it, else some of the standard library's source."""
    if CORPUS.is_file():
        return CORPUS.read_text(encoding="utf-8")
    from blockformer.data.sources import stdlib_dir  # noqa: PLC0415

    files = sorted(stdlib_dir().glob("*.py"))[:200]
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def gpt2_checkpoint(args) -> Path:
    """A random GPT-2-shaped decoder with an 8000-token BPE, saved once under ``--cache``."""
    from blockformer import build_model  # noqa: PLC0415
    from blockformer.run_config import RunConfig  # noqa: PLC0415
    from blockformer.tokenizers import train_tokenizer  # noqa: PLC0415
    from blockformer.train.checkpoint import save_checkpoint  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).parent))
    from common import gpt2_config  # noqa: PLC0415

    layers, d_model, heads = map(int, args.shape.split(","))
    path = args.cache / f"gpt2-{layers}x{d_model}x{heads}-v8000"
    if not (path / "model.safetensors").is_file():
        print(f"building {path} (a BPE tokenizer and random weights, once)", flush=True)
        cfg = gpt2_config(layers, d_model, heads, 8000, 1024)
        save_checkpoint(path, build_model(cfg, seed=0), train_tokenizer("bpe", [corpus_text()], 8000),
                        RunConfig(model=cfg))
    return path


def demo_checkpoint(run: Path | None) -> Path:
    from blockformer.train.checkpoint import resolve_checkpoint  # noqa: PLC0415

    run = run or REPO / "runs" / "stdlib-lm"
    if not run.exists():
        sys.exit(f"{run} not found: run `make demo` first (about 3 minutes on 2 cores), or pass --checkpoint")
    return resolve_checkpoint(run)


def hf_export(ckpt: Path, cache: Path) -> tuple[Path | None, str]:
    """The checkpoint written by ``to_hf`` (once per weights file), or None and why not."""
    from blockformer.errors import UsageError  # noqa: PLC0415
    from blockformer.interop import to_hf  # noqa: PLC0415

    out = cache / f"{ckpt.parent.name if ckpt.name == 'best' else ckpt.name}-hf"
    source, stamp = out / ".source", str((ckpt / "model.safetensors").stat().st_mtime_ns)
    if not source.is_file() or source.read_text() != stamp:
        try:
            to_hf(ckpt, out, overwrite=True)
        except UsageError as e:
            return None, f"to_hf refuses this checkpoint ({e})"
        source.write_text(stamp)
    if not (out / "tokenizer.json").is_file():
        return None, "to_hf writes no tokenizer.json for a byte/char tokenizer; transformers serve needs one"
    return out, ""


# ---------------------------------------------------------------------- workload and figures
def make_prompts(tokenizer, n: int, length: int, rng: np.random.Generator) -> list[str]:
    """``n`` passages of the corpus from seeded offsets, each cut to ``length`` tokens."""
    words = corpus_text().split()
    out = []
    for _ in range(n):
        start = int(rng.integers(0, len(words) - 4 * length))
        out.append(tokenizer.decode(tokenizer.encode(" ".join(words[start:start + 4 * length]))[:length]))
    return out


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start: a Poisson process at ``rate``, or all at 0 for ``inf``."""
    if rate == float("inf"):
        return [0.0] * n
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)).tolist()


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def summarise(server: str, rate: float, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def ms(xs: list[float]) -> tuple[float, float]:  # (median, p99) in milliseconds
        return tuple(float(np.percentile(xs, q)) * 1e3 for q in (50, 99)) if xs else (float("nan"),) * 2

    return {"server": server, "rate": rate, "ok": len(ok), "n": len(results),
            "tok_s": sum(r.output_tokens for r in ok) / duration, "req_s": len(ok) / duration,
            "prompt": np.mean([r.prompt_tokens for r in ok]) if ok else float("nan"),
            "output": np.mean([r.output_tokens for r in ok]) if ok else float("nan"),
            "ttft": ms([r.ttft for r in ok]), "itl": ms([g for r in ok for g in r.itl]),
            "tpot": ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


# ---------------------------------------------------------------------- the client
async def stream_one(client, url: str, payload: dict) -> Result:
    """One streamed completion: when each content chunk came, and the final ``usage``."""
    res, chunks = Result(), 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                obj, now = json.loads(line[5:]), time.perf_counter()
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("choices") and obj["choices"][0].get("text"):
                    if chunks:
                        res.itl.append(now - last)
                    else:
                        res.ttft = now - start
                    chunks, last = chunks + 1, now
                if obj.get("usage"):
                    usage = obj["usage"]
                    res.output_tokens, res.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:  # counted and named, not fatal
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.latency, res.ok = time.perf_counter() - start, chunks > 0 and res.output_tokens > 0
    res.error = "" if res.ok else "no content chunk" if not chunks else "no usage in the last chunk"
    return res


async def send_all(url: str, payloads: list[dict], arrivals: list[float], concurrency: int):
    """Send ``payloads[i]`` at ``arrivals[i]``, at most ``concurrency`` in flight; the
    results and the seconds from the start to the last response."""
    cap = asyncio.Semaphore(concurrency or len(payloads))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(payload: dict, at: float) -> Result:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with cap:
                return await stream_one(client, url, payload)

        results = await asyncio.gather(*(one(p, a) for p, a in zip(payloads, arrivals)))
        return list(results), time.perf_counter() - t0


def request(server: str, model: str, prompt: str, args, index: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    sampled = args.temperature > 0
    if server == "transformers":  # refuses ignore_eos (422); an eos_token_id of -1 turns its EOS check off
        cfg = {"eos_token_id": -1, "do_sample": sampled, "max_new_tokens": args.output_len}
        body["generation_config"] = json.dumps({**cfg, "temperature": args.temperature} if sampled else cfg)
    else:
        body.update({"ignore_eos": True, **({"seed": args.seed + index} if sampled else {})})
    return body


# ---------------------------------------------------------------------- servers
@contextmanager
def serving(server: str, ckpt: Path, hf_dir: Path | None, args, cores: set[int] | None, log: Path):
    """Start the server alone in its own process group, pinned to ``cores``; wait (bounded)
    until it answers ``/health`` or ``/v1/models``; send one warm-up request; yield the
    completions URL and the model's name; stop the server on the way out, error or not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if server == "blockformer":
        cmd = [sys.executable, "-m", "blockformer", "serve", "--checkpoint", str(ckpt), *common,
               "--device", "cpu", "--precision", args.dtype, *shlex.split(args.blockformer_args)]
    else:
        exe = str(Path(sys.executable).with_name("transformers"))
        cmd = [exe, "serve", str(hf_dir), "--continuous-batching", "--device", "cpu", "--dtype",
               {"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
               "--log-level", "warning", *common, *shlex.split(args.transformers_args)]
    print(f"\n== {server}: {shlex.join(cmd)}  (log: {log})", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + args.start_timeout
        while not _answers(base):
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"the server exited with {proc.returncode}; its log ends:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health within {args.start_timeout:.0f} s")
            time.sleep(0.5)
        name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        url = base + "/v1/completions"
        [warm], _ = asyncio.run(send_all(url, [request(server, name, "Warm up.", args, 0)], [0.0], 1))
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        yield url, name
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _answers(base: str) -> bool:
    try:
        return any(httpx.get(base + path, timeout=2).status_code == 200 for path in ("/health", "/v1/models"))
    except httpx.HTTPError:
        return False


def bench_http(server: str, ckpt: Path, hf_dir: Path | None, prompts: dict, schedules: dict, args,
               cores: tuple) -> list[dict]:
    rows = []
    with serving(server, ckpt, hf_dir, args, cores[0], args.cache / f"{server}.log") as (url, name):
        for rate, arrivals in schedules.items():
            bodies = [request(server, name, p, args, i) for i, p in enumerate(prompts[rate])]
            results, duration = asyncio.run(send_all(url, bodies, arrivals, args.concurrency))
            rows.append(summarise(server, rate, results, duration))
            print_row(rows[-1])
    return rows


def bench_sequential(ckpt: Path, prompts: dict, schedules: dict, args, cores: tuple) -> list[dict]:
    """The same schedule through ``generate``, one request at a time, in this process moved
    onto the server's cores (no client runs meanwhile)."""
    import torch  # noqa: PLC0415

    from blockformer.generate import generate, prepare_for_decoding  # noqa: PLC0415
    from blockformer.train.load import load_checkpoint  # noqa: PLC0415

    print("\n== sequential: blockformer.generate.generate, one request at a time, no HTTP", flush=True)
    own, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if cores[0]:
        os.sched_setaffinity(0, cores[0])
    torch.set_num_threads(args.threads)
    try:
        loaded = load_checkpoint(ckpt)
        model = prepare_for_decoding(loaded.model, args.dtype, None, pack=True)  # as `blockformer generate` does
        generate(model, [loaded.tokenizer.encode(prompts[next(iter(prompts))][0])], 2, temperature=0)  # warm-up
        rows = []
        for rate, arrivals in schedules.items():
            ids = [loaded.tokenizer.encode(p) for p in prompts[rate]]
            results, finished, t0 = [], [], time.perf_counter()
            for i, (prompt, at) in enumerate(zip(ids, arrivals)):
                sent = t0 + at  # it has arrived, and a slot is free once request i - cap has finished
                if args.concurrency and i >= args.concurrency:
                    sent = max(sent, finished[i - args.concurrency])
                time.sleep(max(0.0, max(sent, finished[-1] if finished else t0) - time.perf_counter()))
                stamps: list[float] = []
                out = generate(model, [prompt], args.output_len, temperature=args.temperature,
                               seed=args.seed + i if args.temperature > 0 else None,
                               on_token=lambda row, tok: stamps.append(time.perf_counter()))
                finished.append(time.perf_counter())
                results.append(Result(True, stamps[0] - sent, finished[-1] - sent, len(out[0]), len(prompt),
                                      np.diff(stamps).tolist()))
            rows.append(summarise("sequential", rate, results, finished[-1] - t0))
            print_row(rows[-1])
        return rows
    finally:
        os.sched_setaffinity(0, own)
        torch.set_num_threads(threads)


def prefix_test(ckpt: Path, tokenizer, args, cores: tuple) -> list[str]:
    """Three rounds, one request at a time: a fresh ``--prefix-len`` prefix (a miss), then
    ``--num-requests - 1`` requests with the same prefix and other suffixes (hits)."""
    rng, miss, hit = np.random.default_rng(args.seed), [], []
    log = args.cache / "blockformer-prefix.log"
    with serving("blockformer", ckpt, None, args, cores[0], log) as (url, name):
        for _ in range(3):
            prefix = make_prompts(tokenizer, 1, args.prefix_len, rng)[0]
            for i, suffix in enumerate(make_prompts(tokenizer, max(2, args.num_requests), SUFFIX_LEN, rng)):
                body = request("blockformer", name, prefix + "\n" + suffix, args, i)
                [res], _ = asyncio.run(send_all(url, [body], [0.0], 1))
                if not res.ok:
                    raise RuntimeError(f"prefix test: a request failed: {res.error}")
                (hit if i else miss).append(res.ttft)
    m, h = float(np.median(miss)) * 1e3, float(np.median(hit)) * 1e3
    return [f"Prefix cache, blockformer serve: a {args.prefix_len}-token shared prefix and a {SUFFIX_LEN}-"
            f"token suffix, {args.output_len} new tokens, one request at a time, 3 rounds of 1 miss + "
            f"{len(hit) // 3} hits.", "", "| requests | TTFT median (ms) | count |", "| --- | ---: | ---: |",
            f"| first of a round (miss) | {m:.1f} | {len(miss)} |",
            f"| later ones (hits) | {h:.1f} | {len(hit)} |",
            "", f"hit / miss TTFT: {h / m:.2f} (goal: at most 0.33)"]


# ---------------------------------------------------------------------- report
def print_row(r: dict) -> None:
    err = f"; errors: {r['errors']}" if r["errors"] else ""
    print(f"  rate {r['rate']}: {r['ok']}/{r['n']} ok, {r['tok_s']:.1f} output tok/s, "
          f"TTFT {r['ttft'][0]:.0f} ms, TPOT {r['tpot'][0]:.1f} ms{err}", flush=True)


def table(rows: list[dict]) -> list[str]:
    out = ["| server | rate (req/s) | ok | prompt / output tokens | output tok/s | req/s "
           "| TTFT median / p99 (ms) | TPOT median / p99 (ms) | ITL median / p99 (ms) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pairs = " | ".join(f"{r[k][0]:.1f} / {r[k][1]:.1f}" for k in ("ttft", "tpot", "itl"))
        out.append(f"| {r['server']} | {r['rate']} | {r['ok']}/{r['n']} | {r['prompt']:.0f} / "
                   f"{r['output']:.0f} | {r['tok_s']:.1f} | {r['req_s']:.2f} | {pairs} |")
    return out


def ratios(rows: list[dict]) -> list[str]:
    """blockformer serve against each peer at the saturating rate (the highest one run)."""
    top = max((r["rate"] for r in rows), default=None)
    at = {r["server"]: r for r in rows if r["rate"] == top}
    ours, out = at.get("blockformer"), []
    for peer, goal in (("transformers", "goal: >= 2x, TPOT no worse"), ("sequential", "goal: >= 4x")):
        if ours and peer in at and at[peer]["tok_s"] > 0:
            speedup = ours["tok_s"] / at[peer]["tok_s"]
            out.append(f"- rate {top}, blockformer serve / {peer}: output tok/s {speedup:.2f}x, median TPOT"
                       f" {ours['tpot'][0]:.1f} vs {at[peer]['tpot'][0]:.1f} ms ({goal})")
    return out


def main() -> None:
    args = parse_args()
    cores = split_cores(args.threads)
    if cores[1]:
        os.sched_setaffinity(0, cores[1])  # the client, and the builds below, on its own core
    import torch  # noqa: PLC0415 - after the affinity: its thread pool starts on the client's core
    import transformers  # noqa: PLC0415

    from blockformer.tokenizers import load_tokenizer  # noqa: PLC0415
    from blockformer.train.load import read_config  # noqa: PLC0415

    torch.set_num_threads(1)
    args.cache.mkdir(parents=True, exist_ok=True)
    ckpt = gpt2_checkpoint(args) if args.model == "gpt2-small" else demo_checkpoint(args.checkpoint)
    cfg, tokenizer = read_config(ckpt).model, load_tokenizer(ckpt)
    pinning = f"server on cores {sorted(cores[0])}, client on core {min(cores[1])}" if cores[0] else "no pinning"
    lines = [f"# bench_serve: {args.model}, {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, "
             f"vocab {cfg.vocab_size} ({ckpt})", "",
             f"{cpu_kind()}; server {args.threads} thread(s) (OMP_NUM_THREADS), client 1 thread; {pinning}; "
             f"torch {torch.__version__}, transformers {transformers.__version__}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    if args.prefix_test:
        if args.prefix_len + SUFFIX_LEN + 1 + args.output_len > cfg.max_seq_len:
            sys.exit(f"--prefix-len {args.prefix_len} with its suffix and output exceeds the model's "
                     f"{cfg.max_seq_len} positions")
        lines += prefix_test(ckpt, tokenizer, args, cores)
    else:
        rates = [float(r) for r in args.rates.split(",")]
        # Prompts of their own at each rate: a server's prefix cache must not serve one rate's
        # prompts from another's (every server sees the same ones at a given rate).
        prompts = {r: make_prompts(tokenizer, args.num_requests, args.prompt_len, np.random.default_rng([args.seed, i]))
                   for i, r in enumerate(rates)}
        schedules = {r: arrival_times(args.num_requests, r, args.seed) for r in rates}
        rows, notes = [], []
        for server in SERVERS if args.server == "all" else [args.server]:
            hf_dir, why = hf_export(ckpt, args.cache) if server == "transformers" else (None, "")
            try:
                if why:
                    raise RuntimeError(why)
                rows += (bench_sequential(ckpt, prompts, schedules, args, cores) if server == "sequential"
                         else bench_http(server, ckpt, hf_dir, prompts, schedules, args, cores))
            except RuntimeError as e:
                notes.append(f"- {server}: not measured, {e}".replace("\n", " / ")[:800])
                print(notes[-1], flush=True)
        lines += [f"{args.num_requests} requests per rate, Poisson arrivals (seed {args.seed}), prompts of "
                  f"{args.prompt_len} tokens (corpus passages), {args.output_len} new tokens (ignore_eos), "
                  f"temperature {args.temperature}, weights {args.dtype}, concurrency cap {args.concurrency or 'none'}; sequential: "
                  "blockformer.generate, one request at a time, no HTTP.", "",
                  *table(rows), "", *ratios(rows), *notes]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
