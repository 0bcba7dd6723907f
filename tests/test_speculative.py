"""Speculative decoding: greedy output is plain greedy's token for token, whatever the
draft; the accept/reject rule samples from the target's distribution (and a wrong rule
is caught by the same check)."""

import pytest
import torch
from scipy.stats import chisquare

from blockformer import TransformerConfig, build_model
from blockformer.errors import UsageError
from blockformer.generate import generate, speculative_accept, speculative_generate

V = 40
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]


def make(seed=0, position="rope", **kw):
    # A large init and untied head keep greedy outputs varied (not one repeated token).
    base = dict(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                position=position, tie_embeddings=False, init_std=0.5)
    base.update(kw)
    return build_model(TransformerConfig(**base), seed=seed)


# ------------------------------------------------------------------ greedy is exact
@pytest.mark.parametrize("num_draft", [1, 3, 5])
@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_speculative_greedy_equals_plain_greedy_with_a_disagreeing_draft(position, num_draft):
    target = make(0, position)
    draft = make(1, position, n_layers=1, d_model=16, n_heads=2)  # another random model: guesses badly
    plain = generate(target, PROMPTS, 20, temperature=0)
    spec = speculative_generate(target, draft, PROMPTS, 20, num_draft=num_draft, temperature=0)
    assert spec.tokens == plain
    assert len({t for row in plain for t in row}) > 5  # not one repeated token
    assert spec.acceptance_rate < 0.5


@pytest.mark.parametrize("seed", [2, 3])
def test_speculative_greedy_with_the_target_as_draft_accepts_everything(seed):
    target = make(seed, n_kv_heads=2)
    prompt = [[3, 1, 4, 1, 5]]
    spec = speculative_generate(target, target, prompt, 17, num_draft=4, temperature=0)
    assert spec.tokens == generate(target, prompt, 17, temperature=0)
    assert spec.acceptance_rate == 1.0
    # 17 tokens, 5 per round (4 kept + 1 bonus): 4 verifying passes (the last one drafts 1).
    assert spec.target_calls == 1 + 4


def test_speculative_greedy_stops_at_eos_like_plain_greedy():
    target, draft = make(0), make(4, n_layers=1)
    plain = generate(target, PROMPTS, 20, temperature=0)
    eos = plain[0][5]  # a token the first row produces: it must end there
    spec = speculative_generate(target, draft, PROMPTS, 20, num_draft=3, temperature=0, eos_id=eos)
    assert spec.tokens == generate(target, PROMPTS, 20, temperature=0, eos_id=eos)
    assert spec.tokens[0] == plain[0][: plain[0].index(eos)]


def test_speculative_sampling_is_reproducible_and_streams_what_it_returns():
    target, draft = make(0), make(5, n_layers=1)
    seen = {0: [], 1: [], 2: []}
    a = speculative_generate(target, draft, PROMPTS, 15, seed=7, on_token=lambda r, t: seen[r].append(t))
    b = speculative_generate(target, draft, PROMPTS, 15, seed=7)
    assert a.tokens == b.tokens == [seen[0], seen[1], seen[2]]
    assert all(len(row) == 15 for row in a.tokens)
    assert 0 < a.proposed and 0 <= a.accepted <= a.proposed


def test_speculative_rejects_a_draft_with_another_vocabulary():
    with pytest.raises(UsageError, match="draft: vocabulary"):
        speculative_generate(make(0), make(1, vocab_size=V + 1), PROMPTS, 4)
    with pytest.raises(UsageError, match="num_draft"):
        speculative_generate(make(0), make(1), PROMPTS, 4, num_draft=0)


# ------------------------------------------------------------------ the sampling rule
VS = 6
P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
Q0 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])  # far from P0: many rejections
P1 = torch.tensor([0.10, 0.10, 0.40, 0.10, 0.10, 0.20])
Q1 = torch.tensor([0.40, 0.10, 0.10, 0.10, 0.10, 0.20])
P2 = torch.tensor([0.50, 0.10, 0.10, 0.10, 0.10, 0.10])
DRAWS = 40_000  # rows of one batch: independent rounds


def _round(ps, qs, seed):
    """Target probabilities ``ps`` (k+1 of them), draft ``qs`` (k), proposals drawn from
    ``qs``, for DRAWS rows."""
    g = torch.Generator().manual_seed(seed)
    p = torch.stack(ps)[None].expand(DRAWS, len(ps), VS)
    q = torch.stack(qs)[None].expand(DRAWS, len(qs), VS)
    draft = torch.stack([torch.multinomial(qj, DRAWS, True, generator=g) for qj in qs], dim=1)
    return p, q, draft, g


def _pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-squared goodness of fit of ``tokens`` to ``probs``."""
    counts = torch.bincount(tokens, minlength=VS).double()
    return float(chisquare(counts.numpy(), (probs.double() / probs.double().sum() * counts.sum()).numpy()).pvalue)


def test_accept_reject_rule_emits_the_first_token_from_the_target():
    p, q, draft, g = _round([P0, P1], [Q0], seed=0)
    n, nxt = speculative_accept(p, q, draft, generator=g)
    # The batch commits its shortest row's count (0 here), so ``nxt`` is each row's own
    # first token: its proposal where kept, else the residual draw.
    assert int(n.min()) == 0 and 0.3 < float(n.float().mean()) < 0.9
    assert _pvalue(nxt, P0) > 1e-3
    assert _pvalue(draft[:, 0], P0) < 1e-12  # the proposals alone are far from the target


def _first_token_accepting_all(p, q, draft, g):  # wrong: keeps every proposal
    return draft[:, 0]


def _first_token_resampling_from_p(p, q, draft, g):  # wrong: after a rejection draws from p, not p - q
    n, _ = speculative_accept(p, q, draft, generator=g)
    return torch.where(n >= 1, draft[:, 0], torch.multinomial(p[:, 0], 1, generator=g)[:, 0])


@pytest.mark.parametrize("wrong", [_first_token_accepting_all, _first_token_resampling_from_p])
def test_a_wrong_accept_reject_rule_fails_the_same_check(wrong):
    p, q, draft, g = _round([P0, P1], [Q0], seed=0)
    assert _pvalue(wrong(p, q, draft, g), P0) < 1e-6


def test_accept_reject_rule_emits_the_second_token_from_the_target():
    p, q, draft, g = _round([P0, P1, P2], [P0, Q1], seed=1)  # q == p at the first: always kept
    n, nxt = speculative_accept(p, q, draft, generator=g)
    assert int(n.min()) == 1
    assert torch.equal(nxt[n == 2], draft[n == 2, 1])  # kept further: the proposal itself
    assert _pvalue(nxt, P1) > 1e-3


def test_all_kept_draws_the_bonus_token_from_the_last_target_distribution():
    p, q, draft, g = _round([P0, P1, P2], [P0, P1], seed=2)
    n, nxt = speculative_accept(p, q, draft, generator=g)
    assert n.tolist() == [2] * DRAWS
    assert _pvalue(nxt, P2) > 1e-3


def test_greedy_rule_keeps_proposals_while_they_are_the_argmax():
    p = torch.tensor([[[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]])  # argmax 1, 0, 1
    n, nxt = speculative_accept(p, torch.zeros(1, 2, 2), torch.tensor([[1, 1]]), greedy=True)
    assert n.tolist() == [1] and nxt.tolist() == [0]
    n, nxt = speculative_accept(p, torch.zeros(1, 2, 2), torch.tensor([[1, 0]]), greedy=True)
    assert n.tolist() == [2] and nxt.tolist() == [1]


def test_speculative_sampling_through_real_models_draws_the_targets_joint_distribution():
    """Two new tokens for 6000 copies of one prompt: the (first, second) pairs follow the
    target's p(a) p(b | a), computed directly, though the draft is another model."""
    vocab = 6
    target = make(0, vocab_size=vocab, init_std=0.15).eval()
    draft = make(9, vocab_size=vocab, init_std=0.6, n_layers=1).eval()
    prompt = [1, 2, 3]
    out = speculative_generate(target, draft, [prompt] * 6000, 2, num_draft=1, seed=0)
    pairs = torch.tensor([a * vocab + b for a, b in out.tokens])
    with torch.no_grad():
        p_a = target(torch.tensor([prompt]))[0, -1].softmax(-1)  # (V,)
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        p_b = target(seqs)[:, -1].softmax(-1)  # (V, V): row a is p(b | a)
    joint = (p_a[:, None] * p_b).reshape(-1)
    counts = torch.bincount(pairs, minlength=vocab * vocab).double()
    pvalue = float(chisquare(counts.numpy(), (joint.double() / joint.double().sum() * counts.sum()).numpy()).pvalue)
    assert pvalue > 1e-3, pvalue
    with torch.no_grad():
        q_a = draft(torch.tensor([prompt]))[0, -1].softmax(-1)
    assert (q_a - p_a).abs().sum() > 0.3  # the draft alone would be far off
    assert 0.05 < out.acceptance_rate < 0.95
