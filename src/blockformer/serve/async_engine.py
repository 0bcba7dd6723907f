"""The engine on a thread of its own, for an asyncio server.

The thread runs ``Engine.step()`` while there is work and sleeps on a condition when
there is none. The event loop never waits on a model step: it hands commands (add, abort,
a job such as embedding) to the thread through a queue, and receives each request's
outputs on an ``asyncio.Queue`` of its own. A request is checked in the caller's thread
before it is queued, so a bad one fails at once with its message.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable

from ..errors import UsageError
from .engine import Engine, EngineStats, QueueFull
from .params import RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "QueueFull"]


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._stats = engine.stats()
        self._pending = 0  # queued by callers, not yet seen by the thread
        self._lock = threading.Lock()
        self._ids = 0
        self.error: BaseException | None = None

    # --- lifecycle ---

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="blockformer-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop the thread; ``drain``: let running and waiting requests finish first."""
        self._draining = True
        if drain:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while (self.engine.has_work() or self._pending) and loop.time() < deadline and self.alive:
                await asyncio.sleep(0.02)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    # --- requests ---

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       *, source: bool = False) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they are made. Closing the iterator early (a client
        that went away) aborts the request and frees its blocks."""
        request_id = self._admit(prompt, params, request_id, source)
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._send(("add", prompt, params, request_id, source))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def _admit(self, prompt, params: SamplingParams, request_id: str | None, source: bool) -> str:
        if self._draining or not self.alive:
            raise RuntimeError("the engine is shutting down" if self._draining else "the engine is not running")
        self.engine.check_request(prompt, params, source)  # pure: raises UsageError at once
        with self._lock:
            if self._stats.waiting + self._pending >= self.engine.max_queued:
                raise QueueFull(self._stats.waiting + self._pending)
            self._pending += 1
            self._ids += 1
            return request_id or f"cmpl-{self._ids}"

    async def run_job(self, job: Callable):
        """Run ``job(engine)`` on the engine's thread between two steps; its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(("job", job, loop, future))
        return await future

    async def embed(self, texts: list[str], pooling: str = "mean") -> tuple[list[list[float]], int]:
        return await self.run_job(lambda engine: engine.embed(texts, pooling))

    async def translate(self, texts: list[str], beam_size: int = 1, max_tokens: int | None = None
                        ) -> tuple[list[str], int, int]:
        """Greedy translations run in the continuous batch; beam search as a job."""
        decode = self.engine.tokenizer.decode
        if beam_size > 1:
            outs = await self.run_job(lambda engine: engine.translate_beam(texts, beam_size, max_tokens))
            ids = [[t for t in o if t != self.engine.eos_id] for o in outs]
            prompt = sum(len(self.engine.tokenizer.encode(t)) + 1 for t in texts)
            return [decode(i) for i in ids], prompt, sum(map(len, outs))
        results = await asyncio.gather(*(self._translate_one(t, max_tokens) for t in texts))
        return [r.text for r in results], sum(r.prompt_tokens for r in results), sum(r.completion_tokens for r in results)

    async def _translate_one(self, text: str, max_tokens: int | None) -> RequestOutput:
        if max_tokens is None:
            max_tokens = self.engine.default_max_tokens(len(self.engine.tokenizer.encode(text)) + 1)
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        text_parts, last = [], None
        async for out in self.generate(text, params, source=True):
            text_parts.append(out.text)
            last = out
        last.text = "".join(text_parts)
        return last

    # --- the thread ---

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if self.engine.has_work():
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                    self._deliver(outputs)
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - every waiting caller hears of it
            self.error = e
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, RuntimeError(f"the engine stopped: {e}"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self.engine.abort(command[1])
            else:
                self._job(*command[1:])
            self._stats = self.engine.stats()

    def _add(self, prompt, params, request_id, source) -> None:
        with self._lock:
            self._pending -= 1
        try:
            self.engine.add_request(prompt, params, request_id, source=source)
        except (UsageError, QueueFull) as e:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream[0].call_soon_threadsafe(stream[1].put_nowait, e)

    def _job(self, job, loop, future) -> None:
        try:
            result = job(self.engine)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            loop.call_soon_threadsafe(_settle, future, None, e)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one wake-up of each event loop per step, not
        one per request (on one core, the loop's time comes out of the model's)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
