"""Beam search for the encoder-decoder, batched over sentences of different lengths.

Each sentence keeps ``beam_size`` live hypotheses as rows of one (B * beam) batch; the KV
cache follows them with ``cache.reorder``. Every step takes the ``2 * beam`` best
extensions of a sentence's beams: those ending in ``eos`` among the top ``beam`` leave the
beam as finished hypotheses, and the ``beam`` best others continue (fairseq's scheme). A
sentence is done when it has ``beam`` finished hypotheses or reaches its length limit,
where its live beams are finished as they are. Finished hypotheses are ranked by the GNMT
length-normalised score ``log P(Y|X) / lp(Y)``, ``lp(Y) = ((5 + |Y|) / 6)^alpha``
(Wu et al. 2016), with ``|Y|`` the number of generated tokens, ``eos`` included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UsageError
from .batching import BOS_ID, EOS_ID
from ..models.checks import check_int, check_real, trusted_inputs
from .seq2seq import check_seq2seq_args, memory_mask as memory_mask_of, source_batch, target_limits
from .step import eval_mode, prepare_step, resolve_kv_dtype, seq2seq_step


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, without bos and eos
    score: float  # log_prob / length_penalty(length, alpha): what beams are ranked by
    log_prob: float  # sum of the tokens' log-probabilities, eos included
    length: int  # |Y|: generated tokens, eos included when the hypothesis ended with it


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ``((5 + length) / 6) ** alpha``: alpha = 0 ranks by raw log-probability;
    larger alpha favours longer outputs."""
    check_int(length, "length", 0)
    check_real(alpha, "alpha")
    return ((5 + length) / 6) ** alpha


def beam_search(
    model: nn.Module,
    src: torch.Tensor | Sequence[Sequence[int]],
    src_mask: torch.Tensor | None = None,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int | None = None,
    n_best: int = 1,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    use_cache: bool = True,
    compile: bool = False,
    compile_mode: str | None = None,
    kv_cache_dtype: str = "auto",
) -> list[list[Hypothesis]]:
    """The ``n_best`` highest-scoring hypotheses (best first) for each source sentence.

    ``src`` (B, S) with ``src_mask`` (True = real token), or a list of id lists.
    ``max_len`` limits generated tokens (eos included); default: source length + 50. An
    ``eos_id`` outside the vocabulary never occurs: each hypothesis runs to that limit.
    ``kv_cache_dtype``: what the cache holds (``greedy_decode``).
    """
    _check_beam_args(model, beam_size, n_best, alpha, bos_id, eos_id)
    kv_dtype = resolve_kv_dtype(kv_cache_dtype)
    src, src_mask = source_batch(model, src, src_mask)
    limits = target_limits(model, src_mask, max_len)
    B, K, T = src.shape[0], beam_size, max(limits)
    with eval_mode(model):
        encoded = model.encode(src, src_mask)  # checks the source once
    with eval_mode(model), trusted_inputs():  # ... and no step checks its tokens again
        rows = torch.arange(B, device=src.device).repeat_interleave(K)  # beam row -> sentence
        memory, memory_mask = encoded[rows], memory_mask_of(model, src_mask)[rows]  # (B*K, S, d)
        decoder = _BeamDecoder(model, memory, memory_mask, B * K, T, use_cache, compile, compile_mode, kv_dtype)
        beams = _Beams(B, K, T, limits, alpha, bos_id, eos_id, src.device)
        for t in range(T):
            index = beams.step(decoder.logits(beams.history, t), t)
            if index is None:
                break
            decoder.follow(index, t)
    return [sorted(f, key=lambda h: h.score, reverse=True)[:n_best] for f in beams.finished]


def _check_beam_args(model: nn.Module, beam_size: int, n_best: int, alpha: float, bos_id: int, eos_id: int):
    vocab = check_seq2seq_args(model, bos_id, eos_id)
    if not isinstance(beam_size, int) or beam_size < 1:
        raise UsageError(f"beam_size: {beam_size!r}; expected an integer >= 1")
    if vocab is not None and beam_size > vocab:
        raise UsageError(f"beam_size: {beam_size} exceeds the model's vocab_size={vocab}; expected at most that")
    if not isinstance(n_best, int) or not 1 <= n_best <= beam_size:
        raise UsageError(f"n_best: {n_best!r}; expected an integer in [1, beam_size={beam_size}]")
    if not 0 <= check_real(alpha, "alpha") < float("inf"):  # also refuses NaN
        raise UsageError(f"alpha: {alpha}; expected a finite float >= 0")


class _BeamDecoder:
    """The decoder's next-token logits for every beam row, its cache following the beams."""

    def __init__(self, model, memory, memory_mask, rows: int, T: int, use_cache: bool, compile, compile_mode,
                 kv_dtype: torch.dtype | None = None):
        self.model, self.memory, self.memory_mask, self.use_cache = model, memory, memory_mask, use_cache
        if use_cache:
            self.cache, self.step = prepare_step(model, seq2seq_step, rows, T, compile=compile,
                                                 compile_mode=compile_mode, kv_dtype=kv_dtype)
            self.cache_pos = torch.zeros(1, dtype=torch.long, device=memory.device)

    def logits(self, history: torch.Tensor, t: int) -> torch.Tensor:
        """(B*K, V) after ``history[:, : t + 1]``."""
        if not self.use_cache:
            return self.model.decode(history[:, : t + 1], self.memory, self.memory_mask)[:, -1]
        if t == 0:  # passes memory: cross-attention K/V are computed and cached here
            return self.model.decode(history[:, :1], self.memory, self.memory_mask, cache=self.cache,
                                     cache_pos=self.cache_pos)[:, -1]
        return self.step(self.model, history[:, t : t + 1], self.cache, self.cache_pos)

    def follow(self, index: torch.Tensor, t: int) -> None:
        """The rows ``index`` (B*K,) continue, in that order, after step ``t``: the cache moves its
        first t + 1 slots (the rest are unwritten). Each sentence's beams keep to its own rows, which
        share one source, so the cross-attention keys stay where they are."""
        if self.use_cache:
            self.cache.reorder(index, slots=t + 1, cross=False)
            self.cache_pos = self.cache_pos + 1


class _Beams:
    """Each sentence's ``K`` live hypotheses (``history`` rows, bos in column 0, with their
    ``scores``) and the hypotheses it has finished."""

    def __init__(self, B: int, K: int, T: int, limits: list[int], alpha: float, bos_id: int, eos_id: int, device):
        self.B, self.K, self.limits, self.alpha, self.eos_id = B, K, limits, alpha, eos_id
        self.history = torch.full((B * K, T + 1), bos_id, dtype=torch.long, device=device)
        self.scores = torch.zeros(B, K, device=device)
        self.scores[:, 1:] = float("-inf")  # all beams start equal: expand only the first
        self.first_row = torch.arange(B, device=device)[:, None] * K  # (B, 1)
        self.finished: list[list[Hypothesis]] = [[] for _ in range(B)]
        self.done = [False] * B

    def step(self, logits: torch.Tensor, t: int) -> torch.Tensor | None:
        """Extend every beam by one token; the rows (B*K,) that continue, or None when every
        sentence is done."""
        B, K = self.B, self.K
        logp = logits.float().log_softmax(dim=-1)  # (B*K, V)
        V = logp.shape[-1]
        cand = (self.scores.view(B * K, 1) + logp).view(B, K * V)
        top_scores, top_idx = cand.topk(2 * K, dim=1)  # (B, 2K), best first
        parent, tok = top_idx // V, top_idx % V
        is_eos = tok == self.eos_id
        # The K best candidates that do not end: rank eos candidates after all others.
        order = torch.arange(2 * K, device=logp.device) + is_eos.long() * 2 * K
        keep = order.topk(K, dim=1, largest=False).indices  # (B, K), sorted
        self.scores = top_scores.gather(1, keep)
        index = (self.first_row + parent.gather(1, keep)).view(-1)  # (B*K,) rows to continue
        new_history = self.history[index]
        new_history[:, t + 1] = tok.gather(1, keep).view(-1)
        self._finish(t, is_eos[:, :K], top_scores[:, :K], parent[:, :K], new_history)
        self.history = new_history
        return None if all(self.done) else index

    def _finish(self, t: int, is_eos, top_scores, parent, new_history) -> None:
        """Host bookkeeping (one sync per step): eos among the top K leaves the beam; a
        sentence out of length finishes its live beams as they are."""
        K = self.K
        eos_h, top_h, parent_h = is_eos.tolist(), top_scores.tolist(), parent.tolist()
        for b in range(self.B):
            if self.done[b]:
                continue
            for j in range(K):
                if eos_h[b][j]:
                    row = b * K + parent_h[b][j]
                    self._add(b, self.history[row, 1 : t + 1].tolist(), top_h[b][j], t + 1)
            if len(self.finished[b]) >= K:
                self.done[b] = True
            elif t + 1 >= self.limits[b]:
                live = new_history[b * K : (b + 1) * K, 1 : t + 2].tolist()
                for ids, s in zip(live, self.scores[b].tolist()):
                    self._add(b, ids, s, t + 1)
                self.done[b] = True

    def _add(self, b: int, tokens: list[int], log_prob: float, length: int) -> None:
        if log_prob > float("-inf"):  # an impossible continuation is no hypothesis
            score = log_prob / length_penalty(length, self.alpha)
            self.finished[b].append(Hypothesis(tokens, score, log_prob, length))
