"""Speculative decoding: a small draft model proposes ``k`` tokens, the target checks them
in one forward pass (Leviathan et al. 2023; Chen et al. 2023).

Each round the draft decodes ``k`` tokens one at a time (cheap), then the target scores
the last committed token and all ``k`` proposals at once (one pass over its weights
instead of ``k``, which is what decoding at batch 1 is bound by). Proposal ``j`` is kept
with probability ``min(1, p_j(x) / q_j(x))`` (``p`` target, ``q`` draft); at the first
rejection a token is drawn from the residual ``max(0, p - q)`` renormalised, and when all
``k`` are kept a bonus token is drawn from ``p_k``. Every emitted token is then distributed
exactly as the target's own sampling would have produced it (Leviathan et al., Theorem 1).
Greedy decoding keeps a proposal iff it is the target's argmax, so the output is plain
greedy's, token for token.

Both models decode into their own preallocated KV caches. Rejected proposals are rolled
back by position only: the next round writes from the first wrong slot on, and a query
never sees slots past its own, so stale entries are invisible until overwritten. In a
batch, every row commits as many proposals as the row that kept the fewest: the cut is
decided by the other rows, independently of this row's draws, so each position still
follows the rule above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UsageError
from ..models.checks import check_model
from .batching import PAD_ID, PromptBatch, prepare_prompts
from .causal import (
    OnToken, StopFn, check_decoding_args, check_token_count, position_table_window, vocab_size_of,
)
from .sampling import Sampling, sample
from .step import cache_dtype, eval_mode, model_device, resolve_kv_dtype


@dataclass
class SpeculativeOutput:
    """The new ids per prompt, and how well the draft guessed."""

    tokens: list[list[int]]
    proposed: int  # draft tokens offered to the target (summed over running rows)
    accepted: int  # of those, kept by the rule (a batch commits only its shortest row's count)
    target_calls: int  # forward passes of the target, the prefill included

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    num_draft: int = 4,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool = True,
    eos_id: int | None = None,
    on_token: OnToken | None = None,
    stop: StopFn | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_id: int = PAD_ID,
    kv_cache_dtype: str = "auto",
) -> SpeculativeOutput:
    """Continue each prompt by up to ``max_new_tokens`` tokens of ``target``, drafted
    ``num_draft`` at a time by ``draft`` (same vocabulary). Arguments as in ``generate``
    (``kv_cache_dtype``: both models' caches); the result carries the tokens and the draft's
    acceptance rate."""
    sampling = Sampling(temperature, top_k, top_p, do_sample)
    kv_dtype = resolve_kv_dtype(kv_cache_dtype)
    check_token_count("max_new_tokens", max_new_tokens)
    if not isinstance(num_draft, int) or num_draft < 1:
        raise UsageError(f"num_draft: {num_draft!r}; expected an integer >= 1")
    check_decoding_args(target, eos_id, pad_id, seed, generator, on_token, stop, name="target")
    device = _check_draft(target, draft)
    batch = prepare_prompts(prompts, attention_mask, pad_id=pad_id, vocab_size=vocab_size_of(target), device=device)
    _check_fits_the_caches(target, draft, int(batch.lengths.max()) + max_new_tokens)
    if generator is None and seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    stats = SpeculativeOutput([[] for _ in range(batch.tokens.shape[0])], 0, 0, 0)
    if max_new_tokens == 0:
        return stats
    with eval_mode(target), eval_mode(draft):
        pair = _TargetAndDraft(target, draft, batch, max_new_tokens, kv_dtype)
        stats.target_calls += pair.prefill(batch)
        _rounds(pair, max_new_tokens, num_draft, sampling, generator, stats, eos_id, on_token, stop)
    return stats


def _check_draft(target: nn.Module, draft: nn.Module) -> torch.device:
    """A decoder with the target's vocabulary, on the target's device (returned)."""
    check_model(draft, "draft", arch="decoder")
    t_vocab, d_vocab = _vocab(target), _vocab(draft)
    if t_vocab != d_vocab:
        raise UsageError(f"draft: vocabulary of {d_vocab} ids; expected the target's {t_vocab}")
    device = model_device(target)
    if model_device(draft) != device:
        raise UsageError(f"draft: on {model_device(draft)}; expected the target's device {device}")
    return device


def _check_fits_the_caches(target: nn.Module, draft: nn.Module, longest: int) -> None:
    for name, model in (("model", target), ("draft", draft)):
        if position_table_window(model, longest) is not None:  # generate would slide a window; this needs a cache
            raise UsageError(
                f"max_new_tokens: prompt + new tokens = {longest} exceeds the {name}'s max_seq_len="
                f"{model.cfg.max_seq_len} ({model.cfg.position} positions); expected at most that for "
                "speculative decoding"
            )


class _TargetAndDraft:
    """Both models' caches and where each stands: ``last`` (B, 1) is committed but in neither
    cache yet (it goes to slot ``pos``); the draft still has to write ``pending`` from slot
    ``d_start`` on (1 token, or 2 after a round that kept every proposal)."""

    def __init__(self, target: nn.Module, draft: nn.Module, batch: PromptBatch, max_new_tokens: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        B, P = batch.tokens.shape
        device = batch.tokens.device
        self.target, self.draft = target, draft
        self.offset = (P - batch.lengths)[:, None]  # (B, 1): left padding of each row
        self.t_cache = target.new_cache(B, P + max_new_tokens, device=device, dtype=kv_dtype or cache_dtype(target))
        self.d_cache = draft.new_cache(B, P + max_new_tokens, device=device, dtype=kv_dtype or cache_dtype(draft))
        self.last, self.pos = batch.tokens[:, -1:], P - 1
        self.pending, self.d_start = self.last, self.pos

    def run(self, model: nn.Module, cache, toks: torch.Tensor, start: int, prompt_mask=None) -> torch.Tensor:
        """Logits (B, T, V) of ``toks`` (B, T) written into slots ``start ..``."""
        slots = torch.arange(start, start + toks.shape[1], device=toks.device)
        positions = (slots[None, :] - self.offset).clamp(min=0)
        return model(toks, positions=positions, attention_mask=prompt_mask, cache=cache, cache_pos=slots)

    def prefill(self, batch: PromptBatch) -> int:
        """Both caches take all but the last prompt token (that one opens the first round);
        the target calls this made."""
        if batch.tokens.shape[1] == 1:
            return 0
        self.run(self.target, self.t_cache, batch.tokens[:, :-1], 0, batch.mask[:, :-1])
        self.run(self.draft, self.d_cache, batch.tokens[:, :-1], 0, batch.mask[:, :-1])
        return 1

    def propose(self, k: int, sampling: Sampling, generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``k`` draft tokens (B, k), one draft call each, and the draft's probabilities."""
        proposals, q = [], []
        for _ in range(k):
            q_j = _probs(self.run(self.draft, self.d_cache, self.pending, self.d_start)[:, -1], sampling)
            x = q_j.argmax(dim=-1) if sampling.greedy else sample(q_j, generator)
            proposals.append(x)
            q.append(q_j)
            self.d_start += self.pending.shape[1]
            self.pending = x[:, None]
        return (torch.stack(proposals, dim=1) if k else self.last[:, :0]), q

    def verify(self, draft_ids: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """The target's probabilities (B, k+1, V) at ``last`` and each proposal, in one call."""
        checked = torch.cat([self.last, draft_ids], dim=1)
        return _probs(self.run(self.target, self.t_cache, checked, self.pos), sampling)

    def advance(self, n: int, draft_ids: torch.Tensor, nxt: torch.Tensor) -> None:
        """Commit ``n`` proposals and then ``nxt`` (B,); rejected slots are simply rewritten."""
        k = draft_ids.shape[1]
        if n == k:  # the draft never saw its own last proposal: it goes in with the new token
            self.pending = torch.cat([draft_ids[:, k - 1 :] if k else self.pending, nxt[:, None]], dim=1)
        else:
            self.pending, self.d_start = nxt[:, None], self.pos + n + 1
        self.last, self.pos = nxt[:, None], self.pos + n + 1


def _rounds(pair: _TargetAndDraft, N: int, num_draft: int, sampling, generator, stats, eos_id, on_token, stop):
    """Draft, verify, commit, until every row ended or made ``N`` tokens."""
    out = stats.tokens
    done = [False] * len(out)
    emitted = 0
    while emitted < N:
        k = min(num_draft, N - emitted - 1)  # never run past the caches or max_new_tokens
        draft_ids, q = pair.propose(k, sampling, generator)
        p = pair.verify(draft_ids, sampling)  # (B, k+1, V)
        stats.target_calls += 1
        q_all = torch.stack(q, dim=1) if k else p[:, :0]
        n_row, nxt = speculative_accept(p, q_all, draft_ids, greedy=sampling.greedy, generator=generator)
        n = int(n_row.min())  # one sync per round: every row commits n proposals, then one token
        stats.proposed += k * sum(not d for d in done)
        stats.accepted += sum(min(int(a), k) for a, d in zip(n_row.tolist(), done) if not d)
        new = torch.cat([draft_ids[:, :n], nxt[:, None]], dim=1)  # (B, n+1)
        _commit(new.tolist(), out, done, N - emitted, eos_id, on_token, stop)
        emitted += n + 1
        if all(done):
            break
        pair.advance(n, draft_ids, nxt)


def speculative_accept(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_ids: torch.Tensor,
    *,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept/reject rule for one round.

    ``p`` (B, k+1, V): the target's probabilities at each proposal and after the last;
    ``q`` (B, k, V): the draft's, from which ``draft_ids`` (B, k) were drawn. Returns the
    number of proposals kept per row, ``n`` (B,), and the token that follows them (B,):
    at position ``n`` the proposal itself if the row kept more than ``n`` (a batch commits
    its shortest row's count), else a draw from ``max(0, p_n - q_n)`` (from ``p_k`` when
    all were kept). Greedy: keep while the proposal is ``p``'s argmax, then take the argmax.
    """
    B, k = draft_ids.shape
    rows = torch.arange(B, device=p.device)
    if greedy:
        keep = draft_ids == p[:, :k].argmax(dim=-1)
    else:
        p_x = p[:, :k].gather(-1, draft_ids[..., None])[..., 0]  # (B, k)
        q_x = q.gather(-1, draft_ids[..., None])[..., 0]
        u = torch.rand(B, k, device=p.device, generator=generator)
        keep = u * q_x < p_x  # probability min(1, p/q), without dividing by a tiny q
    n = keep.long().cumprod(dim=-1).sum(dim=-1)  # (B,): kept before the first rejection
    m = int(n.min()) if B else 0
    p_m = p[rows, m]  # (B, V)
    if greedy:
        fresh = p_m.argmax(dim=-1)
    else:
        if m < k:
            residual = (p_m - q[rows, m]).clamp(min=0)
            mass = residual.sum(dim=-1, keepdim=True)
            p_m = torch.where(mass > 0, residual, p_m)  # mass 0 means p == q: nothing to correct
        fresh = sample(p_m, generator)  # the race needs no normalising
    nxt = torch.where(n > m, draft_ids[:, m], fresh) if m < k else fresh
    return n, nxt


def _probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities after temperature / top-k / top-p, over the last dim (float32).
    Greedy keeps the processed logits: only their argmax is read."""
    shape = logits.shape
    flat = sampling.process(logits.reshape(-1, shape[-1]))
    return (flat if sampling.greedy else flat.softmax(dim=-1)).reshape(shape)


def _commit(rows, out, done, room: int, eos_id, on_token, stop) -> None:
    """Append each running row's new ids (at most ``room``), ending it at EOS (not kept)
    or when ``stop`` says so (kept)."""
    for r, ids in enumerate(rows):
        for t in ids[:room]:
            if done[r]:
                break
            if eos_id is not None and t == eos_id:
                done[r] = True
                break
            out[r].append(t)
            if on_token is not None:
                on_token(r, t)
            if stop is not None and stop(r, out[r]):
                done[r] = True


def _vocab(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None)
    return cfg.vocab_size if cfg is not None else -1
