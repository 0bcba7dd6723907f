"""Source id lists in, best target id lists out: what a translation command needs."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .batching import BOS_ID, EOS_ID
from .beam import beam_search
from .seq2seq import greedy_decode


def translate(
    model: nn.Module,
    sources: Sequence[Sequence[int]],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int | None = None,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    compile: bool = False,
    kv_cache_dtype: str = "auto",
) -> list[list[int]]:
    """Best target ids for each source (ids ending with ``eos``, as in training): beam
    search, or greedy decoding when ``beam_size == 1`` (the same result, faster)."""
    if beam_size == 1:
        return greedy_decode(model, sources, None, max_len, bos_id, eos_id, compile=compile,
                             kv_cache_dtype=kv_cache_dtype)
    hyps = beam_search(
        model, sources, beam_size=beam_size, alpha=alpha, max_len=max_len, bos_id=bos_id, eos_id=eos_id,
        compile=compile, kv_cache_dtype=kv_cache_dtype,
    )
    return [h[0].tokens for h in hyps]
