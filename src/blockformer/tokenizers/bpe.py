"""Byte-level BPE through the Hugging Face ``tokenizers`` package (Sennrich et al. 2016;
byte-level as in GPT-2, Radford et al. 2019): every Unicode string round-trips exactly.

The same class wraps any ``tokenizer.json`` written by ``tokenizers`` elsewhere. Its
special tokens are found by their usual names and moved to ids 0-3 by a fixed permutation,
so every blockformer tokenizer has ``pad=0, bos=1, eos=2, unk=3``.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import UsageError
from .base import check_id_list, check_text, check_texts, NUM_SPECIALS, SPECIAL_TOKENS, Tokenizer

DEFAULT_VOCAB_SIZE = 4096
MIN_VOCAB_SIZE = NUM_SPECIALS + 256  # the specials and every byte

# Names under which other tokenizers store pad, bos, eos and unk; the first present wins.
SPECIAL_NAMES: dict[str, tuple[str, ...]] = {
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<PAD>"),
    "bos": ("<s>", "<bos>", "[BOS]", "<|bos|>", "<BOS>", "[CLS]", "<|startoftext|>", "<|begin_of_text|>"),
    "eos": ("</s>", "<eos>", "[EOS]", "<|eos|>", "<EOS>", "[SEP]", "<|endoftext|>", "<|end_of_text|>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>", "<UNK>"),
}


def _find_specials(hf: HFTokenizer, source: str) -> list[int]:
    """The ``tokenizers`` ids of pad, bos, eos, unk, found by name."""
    found = []
    for role, names in SPECIAL_NAMES.items():
        ids = [i for i in map(hf.token_to_id, names) if i is not None]
        if not ids:
            expected = " or ".join(names)
            raise UsageError(f"{source}: tokenizer has no {role} token; expected one named {expected}")
        found.append(ids[0])
    if len(set(found)) < len(found):
        raise UsageError(f"{source}: pad/bos/eos/unk share ids {found}; expected four distinct tokens")
    return found


class BPETokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with blockformer's special ids."""

    kind = "bpe"

    def __init__(self, hf: HFTokenizer, source: str = "tokenizer"):
        hf.encode_special_tokens = True  # the text "</s>" is text: encode() never emits a special
        hf.no_padding()  # a tokenizer.json may pad every text to a fixed length (all-MiniLM-L6-v2: 128)
        hf.no_truncation()  # and cut it: batching and length limits are blockformer's
        self.hf = hf
        self._specials = _find_specials(hf, source)
        size = max(hf.get_vocab(with_added_tokens=True).values()) + 1
        self._size = size
        # Our id -> hf id (`_to_hf`) and back (`_to_ours`); None when they already agree.
        self._to_hf = self._to_ours = None
        if self._specials != list(range(NUM_SPECIALS)):
            special = set(self._specials)
            order = np.array(self._specials + [i for i in range(size) if i not in special], dtype=np.int64)
            self._to_hf, self._to_ours = order, np.argsort(order)
        self._fingerprint: str | None = None

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int | None = None) -> BPETokenizer:
        """Learn ``vocab_size`` ids (specials and all 256 bytes included) from ``texts``."""
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        if vocab_size < MIN_VOCAB_SIZE:
            raise UsageError(
                f"tokenizer.vocab_size: {vocab_size} is too small for byte-level BPE; "
                f"expected >= {MIN_VOCAB_SIZE}"
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),  # listed first, so they get ids 0..3
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self._size

    def source_ids(self) -> np.ndarray:
        """``ids[i]``: the wrapped tokenizer's id of our id ``i`` (a permutation)."""
        return np.arange(self._size) if self._to_hf is None else self._to_hf.copy()

    def _ours(self, ids: list[int]) -> list[int]:
        return ids if self._to_ours is None else self._to_ours[ids].tolist()

    def encode(self, text: str) -> list[int]:
        check_text(text)
        return self._ours(self.hf.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        check_texts(texts)
        encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._ours(e.ids) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        check_id_list(ids)
        ids = [i for i in map(int, ids) if NUM_SPECIALS <= i < self._size]
        if self._to_hf is not None:
            ids = self._to_hf[ids].tolist()
        return self.hf.decode(ids, skip_special_tokens=True)

    def fingerprint(self) -> str:
        if self._fingerprint is None:  # hashing a large vocabulary takes a moment: once
            self._fingerprint = super().fingerprint()
        return self._fingerprint

    def _vocab_description(self) -> Any:
        # Only the vocabulary and merges, not the whole JSON: new `tokenizers` releases add
        # fields, and that must not make old checkpoints look mismatched.
        model = json.loads(self.hf.to_str())["model"]
        merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges", [])]
        added = sorted((t.content, i) for i, t in self.hf.get_added_tokens_decoder().items())
        return {"vocab": model.get("vocab"), "merges": merges, "added": added, "specials": self._specials}

    def _to_json(self) -> str:
        return self.hf.to_str(pretty=True)
