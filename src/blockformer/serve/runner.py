"""One scheduled batch in, next-token logits out: the model runner.

The model is called as it is in ``generate``, with a cache object; here the cache is a
view of the paged pool for this call. A decoder's step is one packed call (``PackedView``):
every sequence's new tokens side by side in one input row, so each weight is read once per
step and every matmul has all the step's tokens as rows (on a CPU a matmul of more rows runs
faster per row: 49 GFLOP/s at 16 rows, 83 at 64 on one core, BENCHMARKS.md "Serving").
Attention runs per segment, a segment being the sequences with the same number of new
tokens (all decodes are one). Each row's past and new tokens are laid out right-aligned over
S virtual slots, so that every row's new tokens sit in the same last slots and one causal
pattern is right for all of them; the slots in front of a shorter row are marked invalid.
Decoding rows read their keys and values where the block table points (a C kernel,
``paged_attention.py``); a prefill chunk's are gathered through its block table into a
(rows, H_kv, S, head_dim) copy, one ``index_select`` per layer, for the same fused SDPA
kernel as ``generate``.

An encoder-decoder's rows carry their own sources, so its step is padded calls instead
(``PagedView``): its decoding rows in one call, each prefill chunk in its own. The model
does not know it is being served.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..models.checks import trusted_inputs
from ..nn.attention import sdpa
from ..nn.kv_cache import KVCache, Segment, dequantize_rows, quantize_rows
from . import paged_attention


@dataclass
class RowInput:
    """One row of a call: ``tokens`` to feed (their keys and values go to ``write_slots``),
    after ``n_past`` tokens already in the pool (at ``past_slots``), positions from
    ``n_past``. ``memory``/``memory_mask`` and ``cross``: an encoder-decoder's source, on
    its first call, or its cross-attention keys and values after."""

    tokens: list[int]
    n_past: int
    past_slots: np.ndarray
    write_slots: np.ndarray
    memory: torch.Tensor | None = None  # (1, S_src, d_model)
    memory_mask: torch.Tensor | None = None  # (1, S_src)
    cross: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # per layer: (1, H_kv, S_src, hd)


class PagedView(KVCache):
    """The pool seen as a ``KVCache`` for one call: slots are virtual, ``S`` per row, with
    each row's past followed by its new tokens, right-aligned."""

    def __init__(self, pool: PagedPool, rows: list[RowInput], T: int) -> None:  # noqa: D107 - no super(): no buffers of its own
        self.pool, B = pool, len(rows)
        read, valid, pos = _right_aligned(rows, pool.dummy_slot)
        S = read.shape[1]  # >= T: every row ends at slot S - 1
        device = pool.k[0].device
        self.read = torch.from_numpy(read.reshape(-1)).to(device)
        self.valid, self.pos = torch.from_numpy(valid).to(device), torch.from_numpy(pos).to(device)
        self.write = torch.from_numpy(np.concatenate([r.write_slots for r in rows])).to(device)
        # the (B, T) positions of new tokens that are real: rows are left-padded to T
        real = np.zeros((B, T), dtype=bool)
        for b, r in enumerate(rows):
            real[b, T - len(r.tokens) :] = True
        self.real = torch.from_numpy(real).to(device)
        self.B, self.S = B, S
        self.written = S
        self.cross_k, self.cross_v = _stack_cross(rows, pool.n_layers)
        self.memory_mask = _stack_memory_mask(rows)

    @property
    def span(self) -> int:
        return self.S

    @property
    def max_len(self) -> int:
        return self.S

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.k[0].dtype

    def record(self, cache_pos, positions, attention_mask) -> None:
        pass  # validity and positions were laid out when the view was made

    def update(self, layer: int, cache_pos, k: torch.Tensor, v: torch.Tensor):
        """Write the real new keys/values (B, H_kv, T, hd) into the pool; read every row's
        (B, H_kv, S, hd) back through its block table."""
        real = self.real
        self.pool.write(layer, self.write, k.transpose(1, 2)[real], v.transpose(1, 2)[real])
        return self.pool.gathered(layer, self.read, self.B, self.S, k.dtype)

    def reorder(self, index) -> None:  # pragma: no cover - beam search does not run on the pool
        raise NotImplementedError("a paged view is made for one call")


PACKED_ROWS = 8  # a packed call's token count is rounded up to a multiple of this (``run_packed``)


class PackedView(KVCache):
    """The pool seen as a ``KVCache`` for one packed call: the rows' new tokens side by side
    in one input row, in ``segments`` of consecutive rows with the same number of new
    tokens, each segment's keys right-aligned as in ``PagedView``."""

    def __init__(self, pool: PagedPool, rows: list[RowInput]) -> None:  # noqa: D107 - no super(): no buffers of its own
        self.pool, device = pool, pool.k[0].device
        self.segments, self.reads, start = [], [], 0
        for group in _runs(rows):
            read, valid, pos = _right_aligned(group, pool.dummy_slot)
            S, T = read.shape[1], len(group[0].tokens)
            self.segments.append(Segment(start, len(group), T, torch.arange(S - T, S, device=device),
                                         torch.from_numpy(pos).to(device), torch.from_numpy(valid).to(device)))
            self.reads.append(torch.from_numpy(read).to(device))
            start += len(group) * T
        self.write = torch.from_numpy(np.concatenate([r.write_slots for r in rows])).to(device)
        self.cross_k = self.cross_v = [None] * pool.n_layers
        dtype = pool.k[0].dtype
        self.in_place = kernels.paged_decode_kernel(dtype, device) and paged_attention.kernel(dtype) is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.k[0].dtype

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               masks: list[torch.Tensor | None], scale: float | None) -> torch.Tensor:
        """Write the new keys/values (1, H_kv, N, hd) into the pool, then let each segment's
        queries (1, H, N, hd) attend to its rows' keys: decoding rows read the pool in place
        (the C kernel), the others a gathered copy through SDPA. Returns (1, N, H * hd)."""
        pk, pv = self.pool.k[layer], self.pool.v[layer]  # (slots, H_kv, hd)
        n = len(self.write)  # the real tokens; any after them are padding
        self.pool.write(layer, self.write, k[0, :, :n].transpose(0, 1), v[0, :, :n].transpose(0, 1))
        _, H, N, hd = q.shape
        y = q.new_empty(N, H, hd)
        y[n:] = 0  # the padding's rows: no segment, no attention
        for seg, read, mask in zip(self.segments, self.reads, masks):
            a, b = seg.start, seg.start + seg.rows * seg.tokens
            q_s = q[0, :, a:b].unflatten(1, (seg.rows, seg.tokens)).transpose(0, 1)  # (rows, H, tokens, hd)
            if seg.tokens == 1 and self.in_place and mask is not None and mask.dtype == torch.bool:
                paged_attention.decode_attention(q_s[:, :, 0].contiguous(), pk, pv, read,
                                                 mask.expand(seg.rows, 1, 1, -1).reshape(seg.rows, -1).contiguous(),
                                                 hd**-0.5 if scale is None else scale, y[a:b],
                                                 scales=self.pool.scales(layer))
                continue
            gk, gv = self.pool.gathered(layer, read.view(-1), seg.rows, read.shape[1], q.dtype)
            y_s = sdpa(q_s, gk, gv, mask, False, 0.0, scale)
            y[a:b].view(seg.rows, seg.tokens, H, hd).copy_(y_s.transpose(1, 2))
        return y.view(1, N, H * hd)


def _runs(rows: list[RowInput]) -> list[list[RowInput]]:
    """Consecutive rows with the same number of new tokens."""
    runs: list[list[RowInput]] = []
    for r in rows:
        if runs and len(runs[-1][0].tokens) == len(r.tokens):
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def _right_aligned(rows: list[RowInput], dummy_slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's past then its new tokens, ending at the last of S virtual slots: the pool
    slot each virtual slot reads (the dummy in front of a shorter row), whether it holds a
    token, and that token's position; (B, S) each."""
    S = max(r.n_past + len(r.tokens) for r in rows)
    read = np.full((len(rows), S), dummy_slot, dtype=np.int64)
    valid = np.zeros((len(rows), S), dtype=bool)
    pos = np.zeros((len(rows), S), dtype=np.int64)
    for b, r in enumerate(rows):
        n, first = len(r.tokens), S - len(r.tokens) - r.n_past  # first virtual slot of the row's past
        read[b, first : S - n] = r.past_slots
        read[b, S - n :] = r.write_slots
        valid[b, first:] = True
        pos[b, first:] = np.arange(r.n_past + n)
    return read, valid, pos


def gather(pool: torch.Tensor, read: torch.Tensor, B: int, S: int, out: torch.Tensor) -> torch.Tensor:
    """Rows ``read`` (B * S,) of a pool (slots, H_kv, hd) as (B, H_kv, S, hd), copied into
    ``out``: a buffer kept from call to call, since a fresh one of tens of MB costs more in
    page faults than the copy itself (benchmarks/bench_paged_attention.py)."""
    torch.index_select(pool, 0, read, out=out)
    return out.view(B, S, *pool.shape[1:]).transpose(1, 2)


def _stack_cross(rows: list[RowInput], n_layers: int):
    if not any(r.cross is not None for r in rows):
        return [None] * n_layers, [None] * n_layers
    S = max(r.cross[0][0].shape[2] for r in rows)
    ks, vs = [], []
    for layer in range(n_layers):
        ks.append(torch.cat([_pad_source(r.cross[0][layer], S) for r in rows]))
        vs.append(torch.cat([_pad_source(r.cross[1][layer], S) for r in rows]))
    return ks, vs


def _pad_source(t: torch.Tensor, S: int) -> torch.Tensor:
    return t if t.shape[2] == S else nn.functional.pad(t, (0, 0, 0, S - t.shape[2]))


def _stack_memory_mask(rows: list[RowInput]) -> torch.Tensor | None:
    masks = [r.memory_mask for r in rows if r.memory_mask is not None]
    if not masks:
        return None
    S = max(m.shape[1] for m in masks)
    return torch.cat([nn.functional.pad(m, (0, S - m.shape[1]), value=False) for m in masks])


class PagedPool:
    """Keys and values of every layer, (num_blocks * block_size + 1, H_kv, head_dim) each;
    the last slot is never written (zeros): the invalid slots of a view read it. An int8 pool
    (``kv_cache_dtype="int8"``) holds codes, and each slot's scale per key/value head in
    ``k_scale``/``v_scale`` (slots, H_kv) fp32, as ``KVCache`` keeps them (``quantize_rows``)."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> None:
        probe = model.new_cache(1, 1, dtype=dtype)  # dtype None: the model's own
        self.n_layers = len(probe.k)
        n_kv_heads, head_dim, dtype = probe.k[0].shape[1], probe.k[0].shape[3], probe.k[0].dtype
        slots = num_blocks * block_size + 1
        device = probe.k[0].device
        self.k = [torch.zeros(slots, n_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(slots, n_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(self.n_layers)]
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            self.k_scale = [torch.zeros(slots, n_kv_heads, device=device) for _ in range(self.n_layers)]
            self.v_scale = [torch.zeros(slots, n_kv_heads, device=device) for _ in range(self.n_layers)]
        self.dummy_slot = slots - 1
        self._buffers: dict[str, torch.Tensor] = {}

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values (n, H_kv, hd) of the tokens going to pool ``slots`` (n,): cast to the
        pool's dtype, or an int8 pool's codes and scales."""
        if self.k_scale is not None:
            (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
            self.k_scale[layer].index_copy_(0, slots, k_scale)
            self.v_scale[layer].index_copy_(0, slots, v_scale)
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An int8 pool's key and value scales (slots, H_kv) of ``layer``; None for a float pool."""
        return None if self.k_scale is None else (self.k_scale[layer], self.v_scale[layer])

    def gathered(self, layer: int, read: torch.Tensor, B: int, S: int, dtype: torch.dtype):
        """``layer``'s keys and values at pool slots ``read`` (B * S,), (B, H_kv, S, hd) each, in
        buffers kept from call to call; an int8 pool's dequantized to ``dtype``."""
        k = gather(self.k[layer], read, B, S, self.buffer("k", len(read)))
        v = gather(self.v[layer], read, B, S, self.buffer("v", len(read)))
        if self.k_scale is None:
            return k, v
        k_scale, v_scale = (t[layer].index_select(0, read).view(B, S, -1).transpose(1, 2)
                            for t in (self.k_scale, self.v_scale))
        return dequantize_rows(k, k_scale, dtype), dequantize_rows(v, v_scale, dtype)

    def buffer(self, name: str, rows: int) -> torch.Tensor:
        """A (rows, H_kv, hd) buffer for gathered keys or values: one per name, reused by
        every layer (each layer's gathered keys are read before the next layer gathers)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = self.k[0].new_empty(max(rows, 2 * (0 if buf is None else buf.shape[0])), *self.k[0].shape[1:])
            self._buffers[name] = buf
        return buf[:rows]

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype | None = None) -> int:
        probe = model.new_cache(1, 1, dtype=dtype)
        one = probe.k[0]
        row = one.shape[3] * one.element_size() + (4 if probe.k_scale is not None else 0)  # an int8 row's scale
        return 2 * len(probe.k) * block_size * one.shape[1] * row


class ModelRunner:
    """Turns rows into logits (B, V) after each row's last new token."""

    def __init__(self, model: nn.Module, pool: PagedPool) -> None:
        self.model, self.pool = model, pool
        self.arch = model.cfg.arch
        self.device = pool.k[0].device

    @torch.inference_mode()
    def run_packed(self, rows: list[RowInput]) -> torch.Tensor:
        """A decoder's rows in one packed call: logits (B, V) in the order of ``rows``. The
        packed row is padded to a multiple of ``PACKED_ROWS``: oneDNN keeps a primitive per
        matmul shape, and a server that gave it every token count up to its budget would grow
        by tens of MB in that cache (tests/test_serve_http.py's load test saw it). The padding
        belongs to no segment: it writes no key and attends to nothing, and MoE routes it
        nowhere."""
        order = sorted(range(len(rows)), key=lambda b: len(rows[b].tokens))  # stable: decodes first, as one segment
        rows = [rows[b] for b in order]
        view = PackedView(self.pool, rows)
        n = sum(len(r.tokens) for r in rows)
        N = -(-n // PACKED_ROWS) * PACKED_ROWS
        tokens = torch.zeros(1, N, dtype=torch.long)
        tokens[0, :n] = torch.tensor([t for r in rows for t in r.tokens])
        positions = torch.zeros(1, N, dtype=torch.long)
        positions[0, :n] = torch.from_numpy(np.concatenate([np.arange(r.n_past, r.n_past + len(r.tokens)) for r in rows]))
        real = torch.arange(N) < n
        last = torch.from_numpy(np.cumsum([len(r.tokens) for r in rows]) - 1).to(self.device)
        with trusted_inputs():
            h = self.model.hidden_states(tokens.to(self.device), positions=positions.to(self.device),
                                         attention_mask=real[None].to(self.device),
                                         cache=view, cache_pos=torch.arange(N, device=self.device))
            logits = self.model.head_logits(h[:, last])[0].float()
        return logits[torch.from_numpy(np.argsort(order)).to(self.device)]

    @torch.inference_mode()
    def run(self, rows: list[RowInput]) -> tuple[torch.Tensor, PagedView]:
        T = max(len(r.tokens) for r in rows)
        view = PagedView(self.pool, rows, T)
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        positions = torch.zeros(len(rows), T, dtype=torch.long)
        for b, r in enumerate(rows):
            n = len(r.tokens)
            tokens[b, T - n :] = torch.tensor(r.tokens)
            positions[b, T - n :] = torch.arange(r.n_past, r.n_past + n)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        cache_pos = torch.arange(view.S - T, view.S, device=self.device)
        mask = view.real
        with trusted_inputs():  # the engine put the model in eval mode once; toggling it costs ~1 ms a call
            if self.arch == "encoder-decoder":
                memory = rows[0].memory if len(rows) == 1 else None
                logits = self.model.decode(tokens, memory, rows[0].memory_mask if memory is not None else None,
                                           tgt_mask=mask, positions=positions, cache=view, cache_pos=cache_pos)
            else:  # the head on each row's last position only
                h = self.model.hidden_states(tokens, attention_mask=mask, positions=positions, cache=view,
                                             cache_pos=cache_pos)
                logits = self.model.head_logits(h[:, -1:])
        return logits[:, -1].float(), view
