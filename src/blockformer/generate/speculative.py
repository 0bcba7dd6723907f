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
from .batching import PAD_ID
from .causal import OnToken, StopFn, _check_count, _check_prompt_ids, _prompt_batch, _window, check_decoding_args
from .sampling import Sampling, _process, sample
from .step import cache_dtype, eval_mode, model_device


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
) -> SpeculativeOutput:
    """Continue each prompt by up to ``max_new_tokens`` tokens of ``target``, drafted
    ``num_draft`` at a time by ``draft`` (same vocabulary). Arguments as in ``generate``;
    the result carries the tokens and the draft's acceptance rate."""
    sampling = Sampling(temperature, top_k, top_p, do_sample)
    _check_count("max_new_tokens", max_new_tokens)
    if not isinstance(num_draft, int) or num_draft < 1:
        raise UsageError(f"num_draft: {num_draft!r}; expected an integer >= 1")
    check_decoding_args(target, eos_id, pad_id, seed, generator, on_token, stop, name="target")
    check_model(draft, "draft", arch="decoder")
    t_vocab, d_vocab = _vocab(target), _vocab(draft)
    if t_vocab != d_vocab:
        raise UsageError(f"draft: vocabulary of {d_vocab} ids; expected the target's {t_vocab}")
    device = model_device(target)
    if model_device(draft) != device:
        raise UsageError(f"draft: on {model_device(draft)}; expected the target's device {device}")
    tokens, mask = _prompt_batch(prompts, attention_mask, pad_id, device)
    B, P = tokens.shape
    N = max_new_tokens
    _check_prompt_ids(target, tokens, mask)
    longest = int(mask.sum(dim=1).max()) + N
    for name, model in (("model", target), ("draft", draft)):
        if _window(model, longest) is not None:  # plain generate slides a window; this needs the cache
            raise UsageError(
                f"max_new_tokens: prompt + new tokens = {longest} exceeds the {name}'s max_seq_len="
                f"{model.cfg.max_seq_len} ({model.cfg.position} positions); expected at most that for "
                "speculative decoding"
            )
    if generator is None and seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    stats = SpeculativeOutput(out, 0, 0, 0)
    if N == 0:
        return stats

    with eval_mode(target), eval_mode(draft):
        offset = (P - mask.sum(dim=1))[:, None]  # (B, 1): left padding of each row
        t_cache = target.new_cache(B, P + N, device=device, dtype=cache_dtype(target))
        d_cache = draft.new_cache(B, P + N, device=device, dtype=cache_dtype(draft))

        def run(model, cache, toks, start: int, prompt_mask=None) -> torch.Tensor:
            """Logits (B, T, V) of ``toks`` (B, T) written into slots ``start ..``."""
            slots = torch.arange(start, start + toks.shape[1], device=device)
            positions = (slots[None, :] - offset).clamp(min=0)
            return model(toks, positions=positions, attention_mask=prompt_mask, cache=cache, cache_pos=slots)

        # Prefill both with all but the last prompt token; that one opens the first round.
        if P > 1:
            run(target, t_cache, tokens[:, :-1], 0, mask[:, :-1])
            run(draft, d_cache, tokens[:, :-1], 0, mask[:, :-1])
            stats.target_calls += 1
        last = tokens[:, -1:]  # (B, 1): committed, not yet in either cache
        pos = P - 1  # its slot
        d_pending, d_start = last, pos  # the draft's unwritten tokens (1, or 2 after a full accept)
        emitted = 0
        while emitted < N:
            k = min(num_draft, N - emitted - 1)  # never run past the caches or max_new_tokens
            proposals, q = [], []
            for j in range(k):
                logits = run(draft, d_cache, d_pending, d_start)[:, -1]
                q_j = _probs(logits, sampling)
                x = q_j.argmax(dim=-1) if sampling.greedy else sample(q_j, generator)
                proposals.append(x)
                q.append(q_j)
                d_start += d_pending.shape[1]
                d_pending = x[:, None]
            draft_ids = torch.stack(proposals, dim=1) if k else last[:, :0]  # (B, k)
            checked = torch.cat([last, draft_ids], dim=1)  # (B, k+1): the target scores them at once
            p = _probs(run(target, t_cache, checked, pos), sampling)  # (B, k+1, V)
            stats.target_calls += 1
            q_all = torch.stack(q, dim=1) if k else p[:, :0]
            n_row, nxt = speculative_accept(p, q_all, draft_ids, greedy=sampling.greedy, generator=generator)
            n = int(n_row.min())  # one sync per round: every row commits n proposals, then one token
            live = sum(not d for d in done)
            stats.proposed += k * live
            stats.accepted += sum(min(int(a), k) for a, d in zip(n_row.tolist(), done) if not d)
            new = torch.cat([draft_ids[:, :n], nxt[:, None]], dim=1)  # (B, n+1)
            _commit(new.tolist(), out, done, N - emitted, eos_id, on_token, stop)
            emitted += n + 1
            if all(done):
                break
            if n == k:  # the draft never saw its own last proposal: it goes in with the new token
                d_pending = torch.cat([draft_ids[:, k - 1 :] if k else d_pending, nxt[:, None]], dim=1)
            else:
                d_pending, d_start = nxt[:, None], pos + n + 1
            last, pos = nxt[:, None], pos + n + 1
    return stats


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
    flat = _process(logits.reshape(-1, shape[-1]), sampling)
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
