"""A fixed-logit model for generation tests: the next-token distribution is a table row
chosen by the last token, so the best sequences and their scores are known by hand.

It speaks both interfaces: decoder-only ``model(tokens, ...)`` and encoder-decoder
``encode`` / ``decode`` (the source is ignored).
"""

import torch
from torch import nn

from blockformer import KVCache


class Bigram(nn.Module):
    def __init__(self, probs: dict[int, dict[int, float]], vocab: int = 10) -> None:
        """``probs[prev][next]``; unlisted rows are uniform, unlisted entries of a listed row
        impossible (log 0 = -inf)."""
        super().__init__()
        table = torch.full((vocab, vocab), 1.0 / vocab)
        for prev, row in probs.items():
            table[prev] = 0.0
            for tok, p in row.items():
                table[prev, tok] = p
        self.table = nn.Parameter(table.log(), requires_grad=False)

    def forward(self, tokens, positions=None, attention_mask=None, cache=None, cache_pos=None):
        return self.table[tokens]  # (B, T, V)

    def encode(self, src, src_mask=None):
        return torch.zeros(*src.shape, 1)

    def decode(self, tgt, memory, src_mask=None, tgt_mask=None, positions=None, cache=None, cache_pos=None):
        return self.table[tgt]

    def new_cache(self, batch_size, max_len, *, device=None, dtype=None):
        return KVCache(0, batch_size, max_len, 1, 1, device=device)
