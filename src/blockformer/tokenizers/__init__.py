"""Text to token ids and back: ``char``, ``byte`` and byte-level ``bpe``, one special-id layout.

Every tokenizer has ``pad=0, bos=1, eos=2, unk=3``; ``encode`` adds no specials and
``decode`` skips them; ``save(dir)`` writes ``tokenizer.json`` and ``load_tokenizer`` reads it
back (or any ``tokenizer.json`` written by Hugging Face ``tokenizers``).
"""

from .base import BOS_ID, EOS_ID, FILE_NAME, PAD_ID, SPECIAL_TOKENS, UNK_ID, Tokenizer
from .bpe import BPETokenizer
from .byte import ByteTokenizer
from .char import CharTokenizer
from .load import TOKENIZERS, load_tokenizer, train_tokenizer

__all__ = [
    "Tokenizer",
    "CharTokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "TOKENIZERS",
    "train_tokenizer",
    "load_tokenizer",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "SPECIAL_TOKENS",
    "FILE_NAME",
]
