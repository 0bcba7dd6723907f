"""Argument checks at the models' ``forward``: errors that name the argument.

Without them a bad input fails deep inside (an ``IndexError`` in an embedding, a CUDA
device assert) or, worse, runs: float ids are truncated, a mask passed where positions go
is read as positions. Type, dtype and shape checks read only metadata and cost nothing.
Value checks (ids in range, positions inside a fixed table) read the tensor, so they run
once per call: not under ``torch.compile`` (they would break a full graph) and not inside
``trusted_inputs()``, which generation enters after checking its prompts once, so the
decode loop pays nothing per step.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from collections.abc import Iterator

import torch

from ..config import ADDITIVE_POSITIONS, TransformerConfig
from ..errors import UsageError
from ..nn.kv_cache import KVCache
from ..schema import kind_of
from .embedding import reads_token_types

# Depth of the trusted_inputs() blocks entered in this context: each thread and each asyncio
# task counts its own, so one thread's generation never switches off another's checks.
_TRUSTED: contextvars.ContextVar[int] = contextvars.ContextVar("blockformer_trusted_inputs", default=0)


@contextlib.contextmanager
def trusted_inputs() -> Iterator[None]:
    """Skip the value checks inside this block (the caller has checked its inputs once)."""
    _TRUSTED.set(_TRUSTED.get() + 1)
    try:
        yield
    finally:
        _TRUSTED.set(_TRUSTED.get() - 1)


def _check_values() -> bool:
    return not torch.compiler.is_compiling() and _TRUSTED.get() == 0


def check_ids(tokens: object, vocab_size: int, name: str = "tokens", *, values: bool = True) -> None:
    """``tokens`` must be an integer tensor (batch, length) of ids in ``[0, vocab_size)``."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name}: a {type(tokens).__name__}; expected a torch.long tensor of token ids, "
                        f"shape (batch, length), e.g. torch.tensor([ids])")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"{name}: dtype {tokens.dtype}; expected integer token ids (torch.long)")
    if tokens.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(tokens.shape)}; expected (batch, length) "
                         f"(a single sequence: {name}[None])")
    if values and tokens.numel() and _check_values():
        low, high = (int(v) for v in torch.aminmax(tokens))
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name}: id {bad} is outside [0, {vocab_size}); expected ids below the "
                             f"model's vocab_size={vocab_size}")


def check_mask(mask: object, tokens: torch.Tensor, name: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: a {type(mask).__name__}; expected a bool tensor (batch, length)")
    if tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(f"{name}: shape {tuple(mask.shape)}; expected {tuple(tokens.shape)}, one flag per token "
                         f"(True = real token)")


def check_positions(
    cfg: TransformerConfig, tokens: torch.Tensor, positions: object, name: str = "tokens", *, values: bool = True
) -> None:
    """Explicit ``positions`` must be integer (batch, length) ids; with a fixed position
    table (learned, sinusoidal) every position must lie inside it."""
    table = cfg.max_seq_len if cfg.position in ADDITIVE_POSITIONS else None
    if positions is None:
        if table is not None and tokens.shape[1] > table:
            raise ValueError(
                f"{name}: length {tokens.shape[1]} exceeds max_seq_len={table}, the size of the model's "
                f"{cfg.position} position table; expected at most {table} tokens (generate() slides a window "
                f"over longer texts)"
            )
        return
    if not isinstance(positions, torch.Tensor) or positions.dtype == torch.bool or positions.is_floating_point():
        what = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"positions: {what}; expected an integer tensor of position ids (batch, length) "
                        f"(masks go in attention_mask=)")
    if positions.dim() != 2 or positions.shape[1] != tokens.shape[1] or positions.shape[0] not in (1, tokens.shape[0]):
        raise ValueError(f"positions: shape {tuple(positions.shape)}; expected {tuple(tokens.shape)} like {name}")
    if values and positions.numel() and _check_values():
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0 or (table is not None and high >= table):
            raise ValueError(f"positions: {low if low < 0 else high} is outside [0, {table or 'inf'}); expected "
                             f"positions inside the {cfg.position} table (max_seq_len={table})")


def check_token_types(cfg: TransformerConfig, tokens: torch.Tensor, token_types: object) -> None:
    """Segment ids (BERT's ``token_type_ids``), if given, must be integer (batch, length)
    ids below ``n_token_types``, for a text encoder that has a segment table."""
    if token_types is None:
        return
    if not reads_token_types(cfg):
        why = "no segment table: n_token_types=0" if not cfg.n_token_types else f"a {cfg.arch} reading {cfg.input}"
        raise ValueError(f"token_types: this model takes no segment ids ({why}); expected None, or a text "
                         f"encoder built with n_token_types > 0 (BERT: 2)")
    if not isinstance(token_types, torch.Tensor) or token_types.dtype == torch.bool or \
            token_types.is_floating_point() or token_types.is_complex():
        what = token_types.dtype if isinstance(token_types, torch.Tensor) else type(token_types).__name__
        raise TypeError(f"token_types: {what}; expected an integer tensor of segment ids (batch, length): "
                        f"0 for the first text, 1 for the second")
    if tuple(token_types.shape) != tuple(tokens.shape):
        raise ValueError(f"token_types: shape {tuple(token_types.shape)}; expected {tuple(tokens.shape)} like "
                         f"tokens, one segment id per token")
    if token_types.numel() and _check_values():
        low, high = (int(v) for v in torch.aminmax(token_types))
        if low < 0 or high >= cfg.n_token_types:
            raise ValueError(f"token_types: id {low if low < 0 else high} is outside [0, {cfg.n_token_types}); "
                             f"expected segment ids below the model's n_token_types={cfg.n_token_types}")


# ---------------------------------------------------------------------- arguments
# Plain Python arguments of the public functions (build_model, generate, beam search, ...):
# a wrong type is a TypeError, a wrong value a UsageError (a ValueError), each naming the
# argument. Only ``check_targets`` reads a tensor's values (its ids, once per call, as
# ``check_ids`` does for the tokens); the others read metadata and cost nothing.

SEED_RANGE = 2**64  # torch.manual_seed takes [0, 2**64); a negative seed wraps around silently


def check_int(value: object, name: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` must be an integer (not a bool) in ``[low, high)``; returns it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {value!r}; expected an integer")
    if (low is not None and value < low) or (high is not None and value >= high):
        span = f">= {low}" if high is None else f"in [{low}, {high})"
        raise UsageError(f"{name}: {value!r}; expected an integer {span}")
    return int(value)


def check_real(value: object, name: str) -> float:
    """``value`` must be a real number (an int or float, not a bool); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: {value!r}; expected a float")
    return float(value)


def check_seed(seed: object, name: str = "seed") -> None:
    """None, or an integer in ``[0, 2**64)`` (what ``torch.manual_seed`` takes)."""
    if seed is not None:
        check_int(seed, name, 0, SEED_RANGE)


def check_special_id(value: object, vocab_size: int | None, name: str) -> None:
    """A special id (bos, eos, pad) the model can read and write: ``[0, vocab_size)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {value!r}; expected an integer token id")
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        raise UsageError(f"{name}: {value} is outside [0, {vocab_size or 'inf'}); expected an id the model knows"
                         + (f" (below vocab_size={vocab_size})" if vocab_size is not None else ""))


def check_callable(fn: object, name: str) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name}: {kind_of(fn)}; expected a function or None")


def check_config(cfg: object, name: str = "cfg") -> TransformerConfig:
    """A ``TransformerConfig`` (a run config's model section is ``run.model``)."""
    if not isinstance(cfg, TransformerConfig):
        hint = "; pass run.model, its model section" if type(cfg).__name__ == "RunConfig" else \
            " (TransformerConfig.from_dict turns a dict into one)" if isinstance(cfg, dict) else ""
        raise TypeError(f"{name}: {kind_of(cfg)}; expected a TransformerConfig{hint}")
    return cfg


def check_model(model: object, name: str = "model", arch: str | None = None) -> TransformerConfig | None:
    """An ``nn.Module``; with ``arch``, one of that architecture. A module without ``cfg``
    (a test double, a wrapper) is taken as it is; returns the config when there is one."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name}: {kind_of(model)}; expected a blockformer model (build_model(cfg) or a checkpoint's "
                        f".model)")
    cfg = getattr(model, "cfg", None)
    cfg = cfg if isinstance(cfg, TransformerConfig) else None
    if arch is not None:
        kind = cfg.arch if cfg is not None else None
        if kind is None and arch == "encoder-decoder" and not hasattr(model, "encode"):
            kind = type(model).__name__
        if kind is not None and kind != arch:
            use = "generate()" if kind == "decoder" else "greedy_decode() or beam_search()"
            art = "an" if kind[0] in "aeiou" else "a"
            raise TypeError(f"{name}: {art} {kind} model; expected {'an' if arch[0] in 'aeiou' else 'a'} {arch} "
                            f"model" + (f" (use {use})" if kind in ("decoder", "encoder-decoder") else ""))
    return cfg


def check_targets(targets: object, tokens: torch.Tensor, vocab_size: int, label_smoothing: object) -> None:
    """``targets`` (B, T) ids like ``tokens``, and ``label_smoothing`` in ``[0, 1)``."""
    check_ids(targets, vocab_size, "targets")
    if tuple(targets.shape) != tuple(tokens.shape):
        raise UsageError(f"targets: shape {tuple(targets.shape)}; expected {tuple(tokens.shape)}, one target per "
                         f"input token")
    eps = check_real(label_smoothing, "label_smoothing")
    if not 0.0 <= eps < 1.0:  # also refuses NaN
        raise UsageError(f"label_smoothing: {eps}; expected a float in [0, 1)")


def check_batch(tokens: torch.Tensor, batch: int, name: str, like: str) -> None:
    if tokens.shape[0] != batch:
        raise UsageError(f"{name}: batch of {tokens.shape[0]}; expected {batch} like {like}")


def check_memory(memory: object, tgt: torch.Tensor, src_mask: object, d_model: int) -> None:
    """The encoder's output for ``decode``: a float (batch, length, d_model) tensor with the
    target's batch, and ``src_mask`` (batch, length) beside it."""
    if not isinstance(memory, torch.Tensor):
        raise TypeError(f"memory: {kind_of(memory)}; expected a float tensor (batch, length, d_model), "
                        f"model.encode(src)")
    if not memory.is_floating_point():
        raise TypeError(f"memory: dtype {memory.dtype}; expected a float tensor, the encoder's output")
    if memory.dim() != 3 or memory.shape[-1] != d_model:
        raise UsageError(f"memory: shape {tuple(memory.shape)}; expected (batch, length, d_model={d_model}), "
                         f"model.encode(src)")
    check_batch(memory, tgt.shape[0], "memory", "tgt")
    check_mask(src_mask, memory[..., 0], "src_mask")


def check_cache(cache: object, cache_pos: object, tokens: torch.Tensor, name: str = "tokens") -> None:
    """A ``KVCache`` with the tokens' batch and ``cache_pos`` (T,) integer slots, one per
    token. Metadata only: this runs at every decode step."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: {kind_of(cache)}; expected a KVCache from model.new_cache(batch_size, max_len)")
    if cache_pos is None:
        raise UsageError("cache_pos is required with a cache: the slots these tokens fill")
    if not isinstance(cache_pos, torch.Tensor) or cache_pos.dtype == torch.bool or cache_pos.is_floating_point():
        what = f"dtype {cache_pos.dtype}" if isinstance(cache_pos, torch.Tensor) else kind_of(cache_pos)
        raise TypeError(f"cache_pos: {what}; expected an integer tensor (length,) of cache slots")
    if tuple(cache_pos.shape) != (tokens.shape[1],):
        raise UsageError(f"cache_pos: shape {tuple(cache_pos.shape)}; expected ({tokens.shape[1]},), one slot per "
                         f"token")
    if cache.segments is not None:  # sequences packed side by side: one row
        check_batch(tokens, 1, name, "a cache that packs sequences into one row")
    else:
        check_batch(tokens, cache.valid.shape[0], name, "the cache (new_cache(batch_size, ...))")
