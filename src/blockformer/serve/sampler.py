"""Each request's next token from its row of logits, under its own settings.

The filters run in Hugging Face's and vLLM's order: temperature, top-k, top-p, min-p
(Nguyen et al. 2024: drop tokens below ``min_p`` times the top probability). The draw is
``generate``'s exponential race with the request's own generator, so a seeded request
draws the same tokens whichever requests share its batch. Log-probabilities are those of
the model's distribution (before temperature and filters), as OpenAI reports them.
"""

from __future__ import annotations

import torch

from ..generate.sampling import Sampling, sample
from .params import SamplingParams, TokenLogprob


def blocked_ids(params: SamplingParams, n_generated: int, eos_id: int | None) -> list[int]:
    """Tokens a request may not end with yet: EOS and its stop tokens before ``min_tokens``."""
    if n_generated >= params.min_tokens:
        return []
    ids = list(params.stop_token_ids)
    return ids + [eos_id] if eos_id is not None else ids


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, blocked: list[int]) -> int:
    """One token id from ``logits`` (V,) float32."""
    if blocked:
        logits = logits.index_fill(0, torch.tensor(blocked, device=logits.device), float("-inf"))
    if params.greedy:
        return int(logits.argmax())
    filters = Sampling(params.temperature, params.top_k or None, params.top_p if params.top_p < 1 else None)
    probs = filters.process(logits[None]).softmax(dim=-1)  # generate's temperature, top-k, top-p
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return int(sample(probs, generator)[0])


def logprob_of(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """The chosen token's log-probability and the ``top_n`` most likely alternatives."""
    logp = logits.float().log_softmax(dim=-1)
    top = []
    if top_n:
        values, ids = logp.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logp[token]), top)
