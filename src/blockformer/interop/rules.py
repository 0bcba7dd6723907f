"""One line of a key map: which blockformer tensor is which Hugging Face tensor(s), and how.

The few real transforms are spelled out here, each applied in both directions:

- ``transpose``: GPT-2's ``Conv1D`` stores weights as (in, out), ``nn.Linear`` as (out, in).
- fusing: blockformer keeps Q, K and V in one matrix (rows q, k, v) and a gated FFN's gate
  and up projections in one (rows gate, up); several Hugging Face tensors are concatenated
  along rows on import and split by ``sizes`` on export.
- ``rope``: rows of query/key projections re-ordered between rope's interleaved pairs
  (2i, 2i+1) and Hugging Face's rotate-half pairs (i, i + head_dim/2).
- ``flat``: BART/Marian keep ``final_logits_bias`` as (1, vocab), blockformer as (vocab,).
- ``vocab``: rows indexed by token id, re-ordered so the tokenizer's specials sit at
  blockformer's ids (pad=0, bos=1, eos=2, unk=3); see ``vocab.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: tuple[str, ...]
    sizes: tuple[int, ...] = ()  # rows of each of ``theirs`` when there are several
    transpose: bool = False
    rope: tuple[tuple[int, int], ...] = ()  # (part index, n_heads) of q/k parts to re-order
    flat: bool = False
    vocab: bool = False

    def to_ours(self, parts: list[torch.Tensor], rope_interleaved: bool = False) -> torch.Tensor:
        parts = [p.t() if self.transpose else p for p in parts]
        if rope_interleaved:
            parts = list(parts)
            for i, heads in self.rope:
                parts[i] = half_to_interleaved(parts[i], heads)
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return t.reshape(-1) if self.flat else t

    def to_theirs(self, t: torch.Tensor, rope_interleaved: bool = False) -> list[torch.Tensor]:
        if self.flat:
            t = t.reshape(1, -1)
        parts = list(t.split(list(self.sizes), dim=0)) if len(self.theirs) > 1 else [t]
        if rope_interleaved:
            for i, heads in self.rope:
                parts[i] = interleaved_to_half(parts[i], heads)
        return [(p.t() if self.transpose else p).contiguous() for p in parts]


def linear(ours: str, theirs: str | tuple[str, ...], *, bias: bool, **kw) -> list[Rule]:
    """Rules for an ``nn.Linear`` (weight, and bias when the layer has one)."""
    names = (theirs,) if isinstance(theirs, str) else theirs
    rules = [Rule(f"{ours}.weight", tuple(f"{n}.weight" for n in names), **kw)]
    if bias:
        kw.pop("transpose", None)  # a bias is a vector: nothing to transpose
        rules.append(Rule(f"{ours}.bias", tuple(f"{n}.bias" for n in names), **kw))
    return rules


def norm(ours: str, theirs: str, *, bias: bool, weight: str = "weight", bias_name: str = "bias") -> list[Rule]:
    """Rules for a LayerNorm/RMSNorm (old BERT files call them gamma/beta: aliases)."""
    rules = [Rule(f"{ours}.weight", (f"{theirs}.{weight}",))]
    if bias:
        rules.append(Rule(f"{ours}.bias", (f"{theirs}.{bias_name}",)))
    return rules


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (n_heads * head_dim, ...) from interleaved rope pairs
    (2i, 2i+1) to rotate-half pairs (i, i + head_dim/2): within each head, even rows first."""
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``interleaved_to_half``."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, -1, *rest).transpose(1, 2).reshape(w.shape)
