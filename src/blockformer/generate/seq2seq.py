"""Encoder-decoder decoding: the encoder runs once, the decoder one token at a time.

The first decoder call passes the encoder output, so the cache computes every layer's
cross-attention keys and values once per source; later calls pass only the new token.
Decoding starts from ``bos`` and a sentence ends at ``eos`` or at its own length limit
(by default its source length + 50). Returned ids exclude ``bos`` and ``eos``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..config import ADDITIVE_POSITIONS
from ..errors import UsageError
from ..models.checks import check_int, check_model, check_special_id, kind_of, trusted_inputs
from .batching import BOS_ID, EOS_ID, PAD_ID, prepare_prompts
from .step import eval_mode, model_device, prepare_step, resolve_kv_dtype, seq2seq_step

EXTRA_TARGET_LEN = 50  # default limit: source length + 50 (as in Vaswani et al. 2017)


def target_limits(model: nn.Module, src_mask: torch.Tensor, max_len: int | None) -> list[int]:
    """Each sentence's limit on generated tokens (EOS included): ``max_len``, or its source
    length + 50, capped by an absolute position table's ``max_seq_len``."""
    cfg = getattr(model, "cfg", None)
    table = cfg.max_seq_len if cfg is not None and cfg.position in ADDITIVE_POSITIONS else None
    if max_len is not None:
        if not isinstance(max_len, int) or max_len < 1:
            raise UsageError(f"max_len: {max_len!r}; expected an integer >= 1 or None")
        if table is not None and max_len > table:
            raise UsageError(f"max_len: {max_len} exceeds the model's max_seq_len={table}; expected at most that")
        return [max_len] * src_mask.shape[0]
    limits = [n + EXTRA_TARGET_LEN for n in src_mask.sum(dim=1).tolist()]
    return [min(n, table) for n in limits] if table is not None else limits


def check_seq2seq_args(model: nn.Module, bos_id: int, eos_id: int) -> int | None:
    """An encoder-decoder, a ``bos_id`` it knows and an ``eos_id`` >= 0; its vocabulary size
    (None for a model without a config). An ``eos_id`` at or above the vocabulary size is
    never produced, so every sentence runs to its length limit (what a test of whole-length
    decoding asks for)."""
    cfg = check_model(model, arch="encoder-decoder")
    vocab = cfg.vocab_size if cfg is not None else None
    check_special_id(bos_id, vocab, "bos_id")
    check_special_id(eos_id, None, "eos_id")
    return vocab


def source_batch(
    model: nn.Module, src: torch.Tensor | Sequence[Sequence[int]], src_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(src, src_mask)`` on the model's device, from a tensor or id lists.
    A model whose encoder reads patches or frames takes a float tensor (images or frames)
    and a mask of its real patches or frames (default: all real)."""
    if src_mask is not None and not isinstance(src_mask, torch.Tensor):
        raise TypeError(f"src_mask: {kind_of(src_mask)}; expected a bool tensor (batch, length) or None")
    device = model_device(model)
    adapter = getattr(model, "src_embed", None)
    if hasattr(adapter, "default_mask"):  # models/inputs.py
        if not isinstance(src, torch.Tensor) or not src.is_floating_point():
            raise UsageError(f"src: expected a float tensor of {model.cfg.input} for this model's encoder")
        src = src.to(device)
        return src, (adapter.default_mask(src) if src_mask is None else src_mask.to(device=device, dtype=torch.bool))
    if isinstance(src, torch.Tensor):
        batch = prepare_prompts(src, src_mask, left=False, device=device, name="src", mask_name="src_mask")
    else:  # id lists are padded here (a src_mask given with them is not read)
        batch = prepare_prompts(src, left=False, device=device, name="sources")
    return batch.tokens, batch.mask  # the encoder checks the ids against its vocabulary


def memory_mask(model: nn.Module, src_mask: torch.Tensor) -> torch.Tensor:
    """The mask of the encoder's output: ``src_mask``, or for an encoder reading patches or
    frames with a class token, that token's position in front (``models/inputs.py``)."""
    hidden_mask = getattr(model, "hidden_mask", None)
    return src_mask if hidden_mask is None else hidden_mask(src_mask)


def greedy_decode(
    model: nn.Module,
    src: torch.Tensor | Sequence[Sequence[int]],
    src_mask: torch.Tensor | None = None,
    max_len: int | None = None,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    *,
    use_cache: bool = True,
    compile: bool = False,
    compile_mode: str | None = None,
    check_every: int = 8,
    kv_cache_dtype: str = "auto",
) -> list[list[int]]:
    """The most likely next token at each step, for each source sentence (B, S). An
    ``eos_id`` outside the vocabulary never occurs: each sentence runs to its limit.
    ``kv_cache_dtype``: what the cache holds, its cross-attention keys and values too (``generate``)."""
    check_seq2seq_args(model, bos_id, eos_id)
    check_int(check_every, "check_every", 1)
    kv_dtype = resolve_kv_dtype(kv_cache_dtype)
    src, src_mask = source_batch(model, src, src_mask)
    limits = target_limits(model, src_mask, max_len)
    B, T, device = src.shape[0], max(limits), src.device
    with eval_mode(model):
        memory = model.encode(src, src_mask)  # checks the source once
    with eval_mode(model), trusted_inputs():  # ... and no step checks its tokens again
        limit_t = torch.tensor(limits, device=device)
        out = torch.full((B, T), PAD_ID, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        tok = torch.full((B, 1), bos_id, dtype=torch.long, device=device)
        src_mask = memory_mask(model, src_mask)
        if use_cache:
            cache, step = prepare_step(model, seq2seq_step, B, T, compile=compile, compile_mode=compile_mode,
                                       kv_dtype=kv_dtype)
            cache_pos = torch.zeros(1, dtype=torch.long, device=device)
        seq = tok
        for t in range(T):
            if not use_cache:
                logits = model.decode(seq, memory, src_mask)[:, -1]
            elif t == 0:  # passes memory: cross-attention K/V are computed and cached here
                logits = model.decode(tok, memory, src_mask, cache=cache, cache_pos=cache_pos)[:, -1]
            else:
                logits = step(model, tok, cache, cache_pos)
            nxt = torch.where(done, PAD_ID, logits.argmax(dim=-1))  # (B,)
            out[:, t] = nxt
            done = done | (nxt == eos_id) | (t + 1 >= limit_t)
            if t == T - 1 or (t + 1) % check_every == 0 and bool(done.all()):
                break
            tok = nxt[:, None]
            if use_cache:
                cache_pos = cache_pos + 1
            else:
                seq = torch.cat([seq, tok], dim=1)
    result = []
    for ids, limit in zip(out.tolist(), limits):
        ids = ids[:limit]
        result.append(ids[: ids.index(eos_id)] if eos_id in ids else ids)
    return result

