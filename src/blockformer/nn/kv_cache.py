"""A preallocated key/value cache for incremental decoding.

Shapes never change while decoding (gpt-fast's design): each call writes its keys and
values into fixed slots given by ``cache_pos`` and attends over all ``max_len`` slots, with
a mask hiding the slots not yet written. A compiled decode step therefore sees the same
shapes at every token and never recompiles. Eager decoding on a CPU, where reading a slot
number on the host is free, attends only over the slots written so far (``span``): a short
generation in a long cache then does not pay for the empty slots. Position ``p`` goes to
slot ``p % max_len``: with sliding-window attention the cache is a ring of about two
windows, so decoding can run past ``max_seq_len`` in bounded memory. An int8 cache keeps each slot's
keys (and values) of a head as int8 codes and one fp32 scale, their largest magnitude over 127
(llama.cpp's ``q8_0`` cache, with one scale per head's row instead of per 32 values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..precision import cast


@dataclass
class Segment:
    """Some sequences of a packed call: new tokens ``[start, start + rows * tokens)`` of the
    one input row, read as ``rows`` sequences of ``tokens`` each. Their keys are ``S`` slots
    per sequence: ``cache_pos`` (tokens,) the slots of the new tokens, ``k_pos``/``k_valid``
    (rows, S) each slot's position id and whether it holds a real token."""

    start: int
    rows: int
    tokens: int
    cache_pos: torch.Tensor
    k_pos: torch.Tensor
    k_valid: torch.Tensor


class KVCache:
    """Per-layer self-attention keys/values, plus cross-attention keys/values.

    ``valid[b, s]`` says whether slot ``s`` of row ``b`` holds a real token (padding and
    unwritten slots do not), ``pos[b, s]`` the position id of that token (the position
    signals read it). Cross-attention keys/values are computed once, from the encoder
    output, on the first call that passes ``memory``.

    A cache with ``segments`` (a server's view of its paged pool) packs several sequences
    into one row of new tokens: the projections and FFNs run on every token at once, and
    the cache attends for each segment (``attend``), reading its keys where it keeps them.
    """

    segments: list[Segment] | None = None
    # int8: each slot's scale, per layer and head (B, H_kv, max_len); None for a float cache (a server's view too)
    k_scale: list[torch.Tensor] | None = None
    v_scale: list[torch.Tensor] | None = None

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        if dtype == torch.int8:
            self.k_scale = [torch.zeros(shape[:3], device=device) for _ in range(n_layers)]
            self.v_scale = [torch.zeros(shape[:3], device=device) for _ in range(n_layers)]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.pos = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.cross_k: list[torch.Tensor | None] = [None] * n_layers
        self.cross_v: list[torch.Tensor | None] = [None] * n_layers
        self.memory_mask: torch.Tensor | None = None  # (B, S_src) True for real source tokens
        self.written = 0  # host-side high-water mark: slots [0, written) have been written
        self.unwrapped = False  # host-side: the last recorded positions were all below max_len

    @property
    def span(self) -> int:
        """How many leading slots attention reads: those written so far in eager decoding on
        a CPU; all of them under ``torch.compile`` (fixed shapes) and on accelerators (no
        host read of the slot number)."""
        return self.written if self._counts_on_host() else self.max_len

    def sees_every_slot(self, cache_pos: torch.Tensor) -> bool:
        """Whether the one new token at ``cache_pos`` (just recorded) attends to every slot of
        ``span``, each holding a real token: a batch without padding, decoding at the end of
        the cache. Its mask would be all True, and SDPA without one is faster (15 us a layer
        on a 2-core EPYC). Read on the host, so only where the slots are counted there."""
        if not self._counts_on_host() or cache_pos.shape[0] != 1:
            return False
        span = self.span
        return int(cache_pos[0]) == span - 1 and bool(self.valid[:, :span].all())

    def _counts_on_host(self) -> bool:
        return not torch.compiler.is_compiling() and self.valid.device.type == "cpu"

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def record(
        self, cache_pos: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> None:
        """Mark slots ``cache_pos`` (T,) as written, with their position ids (B, T)."""
        valid = torch.ones_like(positions, dtype=torch.bool) if attention_mask is None else attention_mask
        if self._counts_on_host():
            last = int(cache_pos.max())
            self.written = min(self.max_len, max(self.written, last + 1))
            self.unwrapped = last < self.max_len
        slots = self._slots(cache_pos)
        self.valid.index_copy_(1, slots, valid.bool())
        self.pos.index_copy_(1, slots, positions)

    def _slots(self, cache_pos: torch.Tensor) -> torch.Tensor:
        """The slots of positions ``cache_pos``: the same numbers until a ring cache wraps,
        which the last ``record`` saw on the host where it counts there (one op less a layer)."""
        return cache_pos if self._counts_on_host() and self.unwrapped else cache_pos % self.max_len

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache keeps per slot (keys, values, their int8 scales, validity, positions)."""
        return [*self.k, *self.v, *(self.k_scale or []), *(self.v_scale or []), self.valid, self.pos]

    def update(
        self, layer: int, cache_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` (B, H_kv, T, head_dim) at ``cache_pos``; return the first
        ``span`` slots (int8: their codes; ``scales`` gives their scales)."""
        slots = self._slots(cache_pos)
        if self.k_scale is not None:
            (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
            self.k_scale[layer].index_copy_(2, slots, k_scale)
            self.v_scale[layer].index_copy_(2, slots, v_scale)
        self.k[layer].index_copy_(2, slots, cast(k, self.dtype))
        self.v[layer].index_copy_(2, slots, cast(v, self.dtype))
        span = self.span
        return self.k[layer][:, :, :span], self.v[layer][:, :, :span]

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first ``span`` slots' key and value scales (B, H_kv, span) of an int8 cache; None otherwise."""
        if self.k_scale is None:
            return None
        span = self.span
        return self.k_scale[layer][:, :, :span], self.v_scale[layer][:, :, :span]

    def reorder(self, index: torch.Tensor, slots: int | None = None, cross: bool = True) -> None:
        """Select batch rows ``index`` in place (beam search), keeping tensor identities.
        ``slots``: only the first ``slots`` slots have been written (None: any may have been), so
        only they are moved. ``cross=False`` leaves the cross-attention keys and values (and the
        source mask) as they are: right where ``index`` maps each row to one with the same source."""
        n = self.max_len if slots is None else min(slots, self.max_len)
        for t in [*self.k, *self.v, *(self.k_scale or []), *(self.v_scale or [])]:  # slots on dim 2
            t[:, :, :n].copy_(t[:, :, :n].index_select(0, index))
        for t in (self.valid, self.pos):
            t[:, :n].copy_(t[:, :n].index_select(0, index))
        if not cross:
            return
        for i, (ck, cv) in enumerate(zip(self.cross_k, self.cross_v)):
            if ck is not None:
                self.cross_k[i], self.cross_v[i] = ck.index_select(0, index), cv.index_select(0, index)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, index)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes of ``x`` (..., D) and one fp32 scale per row of D (its largest magnitude over 127):
    ``codes * scale[..., None]`` is ``x`` to within half a scale. A row of zeros has scale 0."""
    scale = x.detach().abs().amax(dim=-1).float() / 127
    codes = (x.float() / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(-127, 127)
    return codes.to(torch.int8), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What ``quantize_rows`` kept: ``codes * scale[..., None]`` in ``dtype``."""
    return (codes.float() * scale[..., None]).to(dtype)
