"""Encoder-decoder decoding: greedy and beam search, with and without the cache, and the
beam's scoring (EOS, length penalty) checked on constructed distributions."""

import math

import pytest
import torch
from torch import nn

from blockformer import TransformerConfig, build_model
from blockformer.errors import UsageError
from blockformer.generate import beam_search, greedy_decode, length_penalty, pad_batch, translate

from fixed_logits import Bigram

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "relative"]
V = 50
SOURCES = [[5, 6, 7, 8, 9, 2], [10, 11, 2], [12, 13, 14, 15, 2]]  # source ids end with eos
NEVER = 99  # an eos id no model here produces: every step is compared


def make(position="rope", **kw):
    base = dict(arch="encoder-decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                position=position, tie_embeddings=False, scale_embeddings=True, init_std=0.2)
    base.update(kw)  # (this init keeps random greedy outputs varied and source-dependent)
    return build_model(TransformerConfig(**base), seed=0)


def sequence_log_prob(model, src, tokens, ends_with_eos=True):
    """log P(tokens [+ eos] | src) from one full forward pass."""
    tgt_in = torch.tensor([[1] + tokens])
    target = tokens + [2] if ends_with_eos else tokens
    logp = model(torch.tensor([src]), tgt_in).log_softmax(-1)[0]
    return sum(logp[i, t].item() for i, t in enumerate(target))


# ------------------------------------------------------------------ greedy, the cache, padding
@pytest.mark.parametrize("n_kv_heads", [4, 1])
@pytest.mark.parametrize("position", POSITIONS)
def test_cached_and_uncached_greedy_give_the_same_tokens(position, n_kv_heads):
    model = make(position, n_kv_heads=n_kv_heads)
    cached = greedy_decode(model, SOURCES, max_len=10, eos_id=NEVER)
    assert cached == greedy_decode(model, SOURCES, max_len=10, eos_id=NEVER, use_cache=False)
    assert len({t for row in cached for t in row}) > 3  # not one repeated token
    assert cached[0] != cached[1]  # and the source matters


@pytest.mark.parametrize("position", POSITIONS)
def test_a_padded_batch_gives_each_sentence_its_own_tokens(position):
    model = make(position)
    alone = [greedy_decode(model, [s], max_len=10)[0] for s in SOURCES]
    assert greedy_decode(model, SOURCES, max_len=10) == alone
    src, mask = pad_batch(SOURCES, left=False)
    assert greedy_decode(model, src, mask, max_len=10) == alone


def test_default_limit_is_source_length_plus_50_per_sentence():
    never_ends = Bigram({1: {5: 1.0}, 5: {5: 1.0}})
    lengths = [len(s) + 50 for s in SOURCES]
    assert [len(o) for o in greedy_decode(never_ends, SOURCES)] == lengths
    assert [len(h[0].tokens) for h in beam_search(never_ends, SOURCES, beam_size=2)] == lengths


def test_absolute_positions_cap_the_default_limit_and_reject_a_longer_one():
    model = make("learned")  # max_seq_len=64 < 6 + 50 is fine; a 20-token source is not
    assert greedy_decode(model, [[5] * 20 + [2]], max_len=None) is not None
    with pytest.raises(UsageError, match="max_len"):
        greedy_decode(model, SOURCES, max_len=65)


# ------------------------------------------------------------------ beam search on a real model
@pytest.mark.parametrize("position", ["sinusoidal", "rope", "relative"])
def test_beam_size_one_equals_greedy(position):
    model = make(position, n_kv_heads=2)
    greedy = greedy_decode(model, SOURCES, max_len=12)
    beam = beam_search(model, SOURCES, beam_size=1, max_len=12)
    assert [h[0].tokens for h in beam] == greedy
    assert translate(model, SOURCES, beam_size=1, max_len=12) == greedy


@pytest.mark.parametrize("position", ["learned", "alibi"])
def test_cached_and_uncached_beams_agree(position):
    model = make(position, n_kv_heads=2)
    a = beam_search(model, SOURCES, beam_size=3, max_len=8, n_best=3)
    b = beam_search(model, SOURCES, beam_size=3, max_len=8, n_best=3, use_cache=False)
    assert [[h.tokens for h in s] for s in a] == [[h.tokens for h in s] for s in b]
    for sa, sb in zip(a, b):
        for ha, hb in zip(sa, sb):
            assert ha.score == pytest.approx(hb.score, abs=1e-4)


def test_beam_scores_are_the_models_log_probs_normalised_by_gnmt():
    # Checks the bookkeeping (reordering the cache and the history): each hypothesis's
    # score must be what a fresh forward pass says about its tokens.
    model = make("rope")
    head = nn.Linear(32, V)  # a head with a bias, to make eos likely enough that some beams end
    head.weight = model.head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[2] = 1.0
    model.head = head
    hyps = beam_search(model, SOURCES, beam_size=4, alpha=0.6, max_len=8, n_best=4)
    ended = 0
    for src, sentence in zip(SOURCES, hyps):
        assert len(sentence) == 4
        assert [h.score for h in sentence] == sorted((h.score for h in sentence), reverse=True)
        for h in sentence:
            with_eos = h.length == len(h.tokens) + 1
            ended += with_eos
            lp = sequence_log_prob(model.eval(), src, h.tokens, ends_with_eos=with_eos)
            assert h.log_prob == pytest.approx(lp, abs=1e-4)
            assert h.score == pytest.approx(lp / ((5 + h.length) / 6) ** 0.6, abs=1e-4)
    assert 0 < ended < 12  # both kinds: ended with eos, and stopped by max_len


# ------------------------------------------------------------------ constructed distributions
# ids: 0 pad, 1 bos, 2 eos, 3.. tokens
TRAP = Bigram({
    1: {3: 0.6, 4: 0.4},  # greedy takes 3 ...
    3: {5: 0.3, 6: 0.25, 7: 0.2, 2: 0.25},  # ... where everything is unlikely
    4: {2: 1.0},  # 4 then eos is the better sentence: 0.4 > 0.6 * 0.3
    5: {2: 1.0}, 6: {2: 1.0}, 7: {2: 1.0},
})


def test_beam_finds_a_higher_scoring_sequence_than_greedy():
    assert greedy_decode(TRAP, [[8, 2]]) == [[3, 5]]  # probability 0.6 * 0.3 * 1 = 0.18
    best = beam_search(TRAP, [[8, 2]], beam_size=2, alpha=0.0, n_best=2)[0]
    assert best[0].tokens == [4] and best[0].log_prob == pytest.approx(math.log(0.4), abs=1e-6)
    assert best[1].tokens == [3, 5] and best[1].log_prob == pytest.approx(math.log(0.18), abs=1e-6)
    assert translate(TRAP, [[8, 2]], beam_size=2, alpha=0.0) == [[4]]


# bos -> eos (0.55): a short sentence; bos -> 3 -> 4 -> 5 -> 6 -> 7 -> eos (0.45): a long one.
SHORT_OR_LONG = Bigram({1: {2: 0.55, 3: 0.45}, 3: {4: 1.0}, 4: {5: 1.0}, 5: {6: 1.0}, 6: {7: 1.0}, 7: {2: 1.0}})


def test_eos_ends_a_hypothesis_which_leaves_the_beam():
    short, long = sorted(beam_search(SHORT_OR_LONG, [[8, 2]], beam_size=2, alpha=0.0, n_best=2)[0],
                         key=lambda h: h.length)
    assert (short.tokens, short.length) == ([], 1)  # ended at once; the beam went on without it
    assert (long.tokens, long.length) == ([3, 4, 5, 6, 7], 6)
    assert short.log_prob == pytest.approx(math.log(0.55), abs=1e-6)
    assert long.log_prob == pytest.approx(math.log(0.45), abs=1e-6)


def test_length_penalty_flips_the_choice_where_its_formula_says():
    # short: log 0.55 / lp(1); long: log 0.45 / lp(6). lp(1) = 1, so they tie at
    # alpha* = ln(log 0.45 / log 0.55) / ln(11 / 6).
    alpha_star = math.log(math.log(0.45) / math.log(0.55)) / math.log(11 / 6)
    assert 0.4 < alpha_star < 0.6
    for alpha, expected in [(0.0, []), (alpha_star - 0.02, []), (alpha_star + 0.02, [3, 4, 5, 6, 7]), (1.0, [3, 4, 5, 6, 7])]:
        best = beam_search(SHORT_OR_LONG, [[8, 2]], beam_size=2, alpha=alpha)[0][0]
        assert best.tokens == expected
        assert best.score == pytest.approx(best.log_prob / ((5 + best.length) / 6) ** alpha, abs=1e-9)


def test_gnmt_length_penalty_values():
    assert length_penalty(1, 0.6) == 1.0
    assert length_penalty(7, 1.0) == 2.0
    assert length_penalty(19, 0.5) == pytest.approx(2.0)
    assert length_penalty(10, 0.0) == 1.0


def test_bad_beam_settings_are_usage_errors():
    with pytest.raises(UsageError, match="beam_size"):
        beam_search(TRAP, [[8, 2]], beam_size=0)
    with pytest.raises(UsageError, match="n_best"):
        beam_search(TRAP, [[8, 2]], beam_size=2, n_best=3)
    with pytest.raises(UsageError, match=r"sources\[0\]"):
        beam_search(TRAP, [[]])


# ------------------------------------------------------------------ the compiled step
@pytest.mark.slow
def test_compiled_step_gives_the_same_translations():
    model = make("relative", n_kv_heads=2)
    greedy = greedy_decode(model, SOURCES, max_len=10, eos_id=NEVER)
    assert greedy_decode(model, SOURCES, max_len=10, eos_id=NEVER, compile=True) == greedy
    eager = beam_search(model, SOURCES, beam_size=3, max_len=10, n_best=3)
    fast = beam_search(model, SOURCES, beam_size=3, max_len=10, n_best=3, compile=True)
    assert [[h.tokens for h in s] for s in fast] == [[h.tokens for h in s] for s in eager]
