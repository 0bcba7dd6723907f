"""The single-token decode step, eager or compiled, and the cache it writes.

The KV cache is preallocated for the whole generation, so the step sees the same shapes at
every token: ``tokens (B, 1)``, ``positions (B, 1)``, ``cache_pos (1,)`` and fixed-size
cache tensors. ``torch.compile`` therefore captures it once and replays it for every token
(gpt-fast's recipe); on CUDA, ``mode="reduce-overhead"`` also records it as a CUDA graph.
On the CPU, where there are no graphs to replay, inductor's ``cpp_wrapper`` calls the step's
kernels from C++ rather than Python: GPT-2 small decoded about 3% faster with it, natively on
an AMX Xeon and capped to AVX2 (BENCHMARKS.md, "The compiled fp32 step on the CPU").

Dynamo checks its guards (each parameter's and cache tensor's dtype, shape and strides, and
more) before every call, about 0.45 ms a token for GPT-2 small on a CPU. Within one
generation every step after the first passes the same objects in the same shapes, so the
step checks them on its first call only (``_guards_checked_once``), as vLLM's compiled
models dispatch to their graph without dynamo's guards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import UsageError
from ..nn.kv_cache import KVCache
from ..precision import DTYPES
from .packed import is_packed

StepFn = Callable[..., torch.Tensor]


def decode_step(
    model: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    cache: KVCache,
    cache_pos: torch.Tensor,
) -> torch.Tensor:
    """Decoder-only: logits (B, V) for the next token after ``tokens`` (B, 1)."""
    return model(tokens, positions=positions, cache=cache, cache_pos=cache_pos)[:, -1]


def seq2seq_step(
    model: nn.Module, tokens: torch.Tensor, cache: KVCache, cache_pos: torch.Tensor
) -> torch.Tensor:
    """Encoder-decoder, after the first step (cross-attention K/V already cached): (B, V)."""
    return model.decode(tokens, None, cache=cache, cache_pos=cache_pos)[:, -1]


_COMPILED: dict[tuple[str, str | None, bool], StepFn] = {}
STATIC_CACHE = "static_decode_cache"  # the attribute of a model that holds its static cache


def prepare_step(
    model: nn.Module, step: StepFn, batch_size: int, max_len: int, *, compile: bool, compile_mode: str | None,
    kv_dtype: torch.dtype | None = None,
) -> tuple[KVCache, StepFn]:
    """A cache for ``batch_size`` rows and ``max_len`` slots, and ``step`` to run on it:
    as is, or compiled (``compile_mode`` None: CUDA graphs on GPU, inductor's default on
    CPU). The cache holds ``kv_dtype`` (None: the dtype attention computes in, ``cache_dtype``)."""
    device, dtype = model_device(model), kv_dtype or cache_dtype(model)
    if compile and is_packed(model):
        raise ValueError("compile: the model's weights are packed for eager CPU decoding (pack_linears), "
                         "which a compiled step cannot read; expected compile=False, or an unpacked model")
    if not compile:
        return model.new_cache(batch_size, max_len, device=device, dtype=dtype), step
    mode = compile_mode or ("reduce-overhead" if device.type == "cuda" else None)
    fn = _guards_checked_once(compiled(step, mode, cpp_wrapper=device.type == "cpu" and mode is None))
    if mode is None or "reduce-overhead" not in mode:
        return model.new_cache(batch_size, max_len, device=device, dtype=dtype), fn
    return static_cache(model, batch_size, max_len, device, dtype), _marking_steps(fn)


def _guards_checked_once(fn: StepFn) -> StepFn:
    """``fn``, a compiled step, with dynamo's guards checked in full on its first call only.

    Later calls run under ``skip_guard_eval_unsafe``, which checks only the guards that tell
    the step's compiled graphs apart (another batch size or cache length compiled earlier).
    That is safe here because the caller (one generation) passes the same model and cache,
    and new tokens of the same shape, at every step: the first call's full check holds for
    all of them. A new generation builds a new step, so its first call is checked again. A
    stance the user set (``force_eager``, ...) is left alone."""
    calls = 0

    def step(*args):
        nonlocal calls
        calls += 1
        if calls == 1 or not _default_stance():
            return fn(*args)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return fn(*args)

    return step


def _default_stance() -> bool:
    """Whether torch.compile runs in its default stance (none set by the user)."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return getattr(stance, "stance", None) == "default" and getattr(stance, "backend", "") is None


def compiled(step: StepFn, mode: str | None = None, cpp_wrapper: bool = False) -> StepFn:
    """``torch.compile(step)``, built once per (step, mode, wrapper) so its graphs are reused
    across calls. ``dynamic=False``: each batch size and cache length gets its own static graph.
    ``cpp_wrapper``: the graph's kernels called from C++ (torch takes a mode or options, not both)."""
    key = (step.__name__, mode, cpp_wrapper)
    if key not in _COMPILED:
        options = {"cpp_wrapper": True} if cpp_wrapper else None
        _COMPILED[key] = torch.compile(step, fullgraph=True, dynamic=False, mode=mode, options=options)
    return _COMPILED[key]


def static_cache(
    model: nn.Module, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype
) -> KVCache:
    """One cache per model, kept on it (``model.static_decode_cache``) and reused while its
    shape fits, with its tensors marked static: a CUDA graph replays on fixed addresses, and
    a new cache would force a re-record. Reuse is safe because each slot is rewritten before
    any query can see it (a query attends only to slots up to its own)."""
    cache = getattr(model, STATIC_CACHE, None)
    if cache is None or cache.valid.shape != (batch_size, max_len) or cache.dtype != dtype:
        cache = model.new_cache(batch_size, max_len, device=device, dtype=dtype)
        for t in cache.tensors:
            torch._dynamo.mark_static_address(t)
        setattr(model, STATIC_CACHE, cache)  # a plain attribute: not a submodule, not in the state dict
    cache.valid.zero_()
    cache.written = 0
    cache.cross_k = [None] * len(cache.cross_k)
    cache.cross_v = [None] * len(cache.cross_v)
    cache.memory_mask = None
    return cache


def _marking_steps(fn: StepFn) -> StepFn:
    """Tell CUDA-graph trees that each call starts a new step (its previous outputs are
    consumed), as a generation loop needs."""

    def step(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(*args)

    return step


def cache_dtype(model: nn.Module) -> torch.dtype:
    """The dtype attention computes in: the autocast dtype when autocast is on for the
    model's device, else the parameters' dtype."""
    param = next(model.parameters())
    device_type = param.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return param.dtype


KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "int8")


def resolve_kv_dtype(name: str | None) -> torch.dtype | None:
    """The dtype a ``kv_cache_dtype`` option names (``auto``/None: the model's own, ``cache_dtype``).

    A bf16 or fp16 cache under an fp32 model halves the cache's bytes (llama.cpp keeps fp16 by
    default; vLLM's ``--kv-cache-dtype``): keys and values are rounded as they are written, and a
    one-token step on a CPU reads them as they are, padded or compiled (``nn/decode_attention.py``);
    a prompt's attention reads an fp32 copy. fp16 keeps 3 more mantissa bits, bf16 fp32's range (fp16
    overflows past 65504). int8 (a quarter of fp32's bytes) keeps each slot's head as codes and a scale
    (``KVCache``; llama.cpp's ``q8_0`` cache), to within half a scale."""
    if name is None or name == "auto":
        return None
    if name not in KV_CACHE_DTYPES:
        raise UsageError(f"kv_cache_dtype: {name!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    return torch.int8 if name == "int8" else DTYPES[name]


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off while generating; the caller's train/eval state is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)
