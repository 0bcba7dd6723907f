"""sacreBLEU's BLEU and chrF through `generate.scoring`: figures recomputed by hand."""

import math

import pytest

from blockformer.errors import UsageError
from blockformer.generate.scoring import bleu, chrf, translation_scores

# sacreBLEU's README example, with its first reference set.
HYPS = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
REFS = ["The dog bit the man.", "It was not unexpected.", "The man bit him first."]


def test_bleu_matches_the_hand_computed_ngram_precisions():
    # 13a splits off the final ".": hypothesis tokens 6 + 4 + 7 = 17, reference 6 + 5 + 6 = 17.
    # Matches: 1-grams 6 + 2 ("It", ".") + 4 ("The", "man", "him", ".") = 12 of 17;
    # 2-grams 5 + 0 + 1 ("The man") = 6 of 14; 3-grams 4 of 11; 4-grams 3 of 8; BP = 1.
    expected = 100 * (12 / 17 * 6 / 14 * 4 / 11 * 3 / 8) ** 0.25
    score = bleu(HYPS, REFS)
    assert score.score == pytest.approx(expected, abs=1e-9)
    assert score.score == pytest.approx(45.07, abs=0.005)
    assert score.summary.startswith("BLEU = 45.07 70.6/42.9/36.4/37.5 (BP = 1.000 ratio = 1.000 hyp_len = 17")
    assert score.signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_bleu_brevity_penalty_and_case():
    # A hypothesis shorter than its reference (c = 6 < r = 8) pays BP = exp(1 - r/c).
    hyp, ref = ["a b c d e f"], ["a b c d e f g h"]
    precisions = [1.0, 1.0, 1.0, 1.0]  # every n-gram of the hypothesis is in the reference
    assert bleu(hyp, ref).score == pytest.approx(100 * math.exp(1 - 8 / 6) * math.prod(precisions) ** 0.25)
    assert bleu(["the cat sat on the mat"], ["the cat sat on the mat"]).score == pytest.approx(100)
    # Cased: "The" != "the", so one unigram, bigram, trigram and 4-gram fewer match.
    cased = bleu(["The cat sat on the mat"], ["the cat sat on the mat"]).score
    assert cased == pytest.approx(100 * (5 / 6 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25)


def test_chrf_matches_the_hand_computed_character_ngrams():
    # "abcdefg" vs "abcdefx": at order n, 7 - n + 1 n-grams each side, 7 - n of them shared,
    # so precision = recall = (7 - n) / (8 - n) for n = 1..6, and chrF2 is their mean.
    expected = 100 * sum((7 - n) / (8 - n) for n in range(1, 7)) / 6
    score = chrf(["abcdefg"], ["abcdefx"])
    assert score.name == "chrF2" and score.score == pytest.approx(expected, abs=1e-9)
    assert score.score == pytest.approx(73.45, abs=0.005)
    assert score.signature.startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")
    assert chrf(HYPS, HYPS).score == pytest.approx(100)


def test_char_tokenized_bleu_scores_single_words():
    words = ["cba", "edcba", "jihg"]
    assert bleu(words, words).score == pytest.approx(0.0)  # 13a: one word each, no 2-grams at all
    assert bleu(words, words, tokenize="char").score == pytest.approx(100.0)
    scores = translation_scores(words, words, tokenize="char")
    assert set(scores) == {"bleu", "chrf"} and scores["chrf"].score == pytest.approx(100.0)
    assert "tok:char" in scores["bleu"].signature


def test_bad_inputs_are_usage_errors():
    with pytest.raises(UsageError, match="references: 1 lines for 2 translations"):
        bleu(["a", "b"], ["a"])
    with pytest.raises(UsageError, match="no sentences to score"):
        chrf([], [])
    with pytest.raises(UsageError, match="tokenize: 'moses'; expected one of 13a"):
        bleu(["a"], ["a"], tokenize="moses")
