"""Translation quality against references: sacreBLEU's BLEU and chrF (Post 2018).

Scores are computed on detokenised text (what a translation system outputs), cased, with
sacreBLEU's own tokenisation (``13a`` by default, the WMT standard), so figures compare
across papers; each comes with its sacreBLEU signature, which states exactly how it was
computed (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import UsageError

# sacreBLEU tokenizers that need no extra package ("char" splits into characters: the
# metric for scripts without spaces, and for tiny synthetic outputs of one "word").
BLEU_TOKENIZERS = ("13a", "intl", "char", "zh", "none")


@dataclass
class Score:
    """One corpus-level metric: its value (0-100), sacreBLEU's signature and summary line."""

    name: str  # "BLEU" or "chrF2"
    score: float
    signature: str
    summary: str  # e.g. "BLEU = 34.51 67.1/42.3/28.9/20.1 (BP = 0.987 ratio = 0.987 ...)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[list[str], list[str]]:
    if len(hypotheses) != len(references):
        raise UsageError(
            f"references: {len(references)} lines for {len(hypotheses)} translations; "
            "expected one reference line per source line"
        )
    if not hypotheses:
        raise UsageError("references: no sentences to score; expected at least one line")
    return [str(h) for h in hypotheses], [str(r) for r in references]


def bleu(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> Score:
    """Corpus BLEU (Papineni et al. 2002) of detokenised ``hypotheses`` against one
    reference each: cased, sacreBLEU tokenisation ``tokenize``, exponential smoothing."""
    from sacrebleu.metrics import BLEU  # noqa: PLC0415 - imported when scoring only

    if tokenize not in BLEU_TOKENIZERS:
        raise UsageError(f"tokenize: {tokenize!r}; expected one of {', '.join(BLEU_TOKENIZERS)}")
    hyps, refs = _check(hypotheses, references)
    metric = BLEU(tokenize=tokenize)
    result = metric.corpus_score(hyps, [refs])
    return Score("BLEU", float(result.score), str(metric.get_signature()), str(result))


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> Score:
    """Corpus chrF2 (Popovic 2015): character 6-gram F-score with recall weighted 2x."""
    from sacrebleu.metrics import CHRF  # noqa: PLC0415

    hyps, refs = _check(hypotheses, references)
    metric = CHRF()
    result = metric.corpus_score(hyps, [refs])
    return Score(f"chrF{metric.beta}", float(result.score), str(metric.get_signature()), str(result))


def translation_scores(
    hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a"
) -> dict[str, Score]:
    """``{"bleu": Score, "chrf": Score}`` for one system output against one reference set."""
    return {"bleu": bleu(hypotheses, references, tokenize), "chrf": chrf(hypotheses, references)}
