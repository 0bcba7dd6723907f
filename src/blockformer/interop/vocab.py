"""Token ids across the two conventions.

Every blockformer tokenizer puts pad, bos, eos and unk at ids 0-3 (the trainer, the loss
and the generators rely on it); a Hugging Face tokenizer puts them anywhere (BERT: 0, 101,
102, 100). Importing therefore re-orders every tensor whose rows are token ids by the
tokenizer's permutation, and exporting undoes it, so the two models give the same logits
for the same text. A role the tokenizer lacks (GPT-2 has only ``<|endoftext|>``) is added
as a new special token with a new row (the mean of the others); a tokenizer shorter than
the embedding (T5: 32100 tokens, 32128 rows) is padded with ``<unused_N>`` tokens so ids
and rows stay one-to-one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from ..errors import UsageError
from ..tokenizers.base import FILE_NAME, SPECIAL_TOKENS
from ..tokenizers.bpe import SPECIAL_NAMES, BPETokenizer


@dataclass
class VocabMap:
    """``order[i]`` is the Hugging Face id of blockformer id ``i``; rows at or above
    ``n_theirs`` are new (added specials or padding) and have no Hugging Face row."""

    order: np.ndarray
    n_theirs: int

    @classmethod
    def identity(cls, size: int) -> "VocabMap":
        return cls(np.arange(size), size)

    @property
    def size(self) -> int:
        return len(self.order)

    def to_ours(self, t: torch.Tensor) -> torch.Tensor:
        """Rows in Hugging Face order (n_theirs, ...) -> rows in blockformer order (size, ...)."""
        if self.size > t.shape[0]:  # new rows start as the mean of the others
            t = torch.cat([t, t.mean(dim=0, keepdim=True).expand(self.size - t.shape[0], *t.shape[1:])])
        return t[torch.as_tensor(self.order)]

    def to_theirs(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse: blockformer rows back in Hugging Face id order (added rows at the end)."""
        return t[torch.as_tensor(np.argsort(self.order))]

    def their_id(self, ours: int) -> int:
        return int(self.order[ours])


def import_tokenizer(
    directory: Path, n_rows: int, file: Path | None = None
) -> tuple[BPETokenizer, VocabMap] | None:
    """The directory's ``tokenizer.json`` (or ``file``) as a blockformer tokenizer, and the id
    map for an embedding of ``n_rows`` rows; None when there is no ``tokenizer.json``."""
    file = directory / FILE_NAME if file is None or file.is_dir() else file
    if not file.is_file():
        return None
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception
        raise UsageError(f"{file}: not a tokenizer the `tokenizers` package can read ({e})") from None
    ids = hf.get_vocab(with_added_tokens=True).values()
    if not ids:
        raise UsageError(f"{file}: an empty vocabulary; expected a tokenizer with tokens")
    size = max(ids) + 1
    if size > n_rows:
        raise UsageError(f"{file}: {size} tokens but the model has {n_rows} embedding rows; expected at most that")
    missing = [name for name, (role, names) in zip(SPECIAL_TOKENS, SPECIAL_NAMES.items())
               if not any(hf.token_to_id(n) is not None for n in names)]
    if size < n_rows:  # pad first, so the padding keeps the model's own ids
        hf.add_special_tokens([AddedToken(f"<unused_{i}>", special=True) for i in range(n_rows - size)])
    if missing:
        hf.add_special_tokens([AddedToken(name, special=True) for name in missing])
    tokenizer = BPETokenizer(hf, source=str(file))
    order = tokenizer.source_ids()
    return tokenizer, VocabMap(order, n_rows)


def hf_special_ids(tokenizer, vmap: VocabMap) -> dict[str, int]:
    """Hugging Face ids of pad/bos/eos/unk, for an exported ``config.json``."""
    return {role: vmap.their_id(getattr(tokenizer, f"{role}_id")) for role in ("pad", "bos", "eos", "unk")}


MASK_NAMES = ("[MASK]", "<mask>", "<MASK>", "<|mask|>")


def token_roles(tokenizer: BPETokenizer, ids: dict[str, int], arch: str) -> dict[str, str]:
    """transformers' special-token roles of an exported tokenizer, by token name (keys as in
    ``tokenizer_config.json``: ``pad_token``, ...). pad, bos, eos and unk always; an encoder's
    or encoder-decoder's ``cls_token`` and ``sep_token`` are its bos and eos (BERT's [CLS] and
    [SEP], BART's <s> and </s>); ``mask_token`` is the tokenizer's own mask token or, for an
    encoder without one, unk, the token blockformer's masked-LM training puts in masked places."""
    roles = {f"{r}_token": tokenizer.hf.id_to_token(i) for r, i in ids.items()}
    if arch != "decoder":
        roles.update(cls_token=roles["bos_token"], sep_token=roles["eos_token"])
    mask = next((n for n in MASK_NAMES if tokenizer.hf.token_to_id(n) is not None), None)
    if mask is not None or arch == "encoder":
        roles["mask_token"] = mask if mask is not None else roles["unk_token"]
    return roles
