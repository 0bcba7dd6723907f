"""Serving: many requests at once through one model, a step at a time.

The rooms, as in vLLM: ``blocks`` (the KV pool's block tables, prefix hashes, eviction),
``scheduler`` (who runs each step: continuous batching, chunked prefill, preemption),
``runner`` (one scheduled batch through the model, attention reading the paged pool),
``sampler`` (each request's own settings and generator), ``engine`` (the loop, and
``LLM`` for offline use), ``async_engine`` (the loop on a thread, for the server) and
``api`` (the OpenAI-compatible HTTP server, ``blockformer serve``).
"""

from .engine import LLM, Engine, EngineStats, QueueFull
from .params import RequestOutput, SamplingParams, TokenLogprob

__all__ = ["LLM", "Engine", "EngineStats", "QueueFull", "RequestOutput", "SamplingParams", "TokenLogprob"]
