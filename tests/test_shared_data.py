"""The shared data sets, when present beside the repository (skipped otherwise)."""

from blockformer.data import read_pairs
from blockformer.tokenizers import train_tokenizer


def test_multi30k_val_is_aligned_and_round_trips_through_joint_bpe(shared_data):
    d = shared_data / "multi30k"
    pairs = read_pairs(d / "val.de.gz", d / "val.en.gz")
    assert len(pairs) == 1014
    tok = train_tokenizer("bpe", [s for pair in pairs for s in pair], vocab_size=1000)
    assert all(tok.decode(tok.encode(s)) == s for pair in pairs[:200] for s in pair)


def test_tinyshakespeare_has_65_characters(shared_data):
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    tok = train_tokenizer("char", [text])
    assert tok.vocab_size == 65 + 4  # the characters and pad/bos/eos/unk
    assert tok.decode(tok.encode(text[:5000])) == text[:5000]
