"""Tokenizers: exact Unicode round trips, the shared special ids, save/load, HF tokenizer.json files."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from blockformer.errors import UsageError
from blockformer.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    load_tokenizer,
    train_tokenizer,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "小明打小红",
    "小红打小明。中文也要能来回转换。",
    "emoji: 😀 👍🏽 👩‍👩‍👧 🇩🇪",
    "lines\nand\r\nwindows\tand tabs\n\n  indented",
    "specials as text: <pad> <s> </s> <unk> [PAD] [SEP]",
    "",
]
CORPUS = TEXTS * 20 + ["def f(x):\n    return x + 1\n"] * 20


@pytest.fixture(scope="module")
def tokenizers():
    sizes = {"char": None, "byte": None, "bpe": 400}
    return {kind: train_tokenizer(kind, CORPUS, vocab_size=size) for kind, size in sizes.items()}


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact_on_unicode(tokenizers, kind, text):
    tok = tokenizers[kind]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(4 <= i < tok.vocab_size for i in ids)  # encode adds no specials, even for "</s>" as text


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_special_ids_are_shared_and_skipped_by_decode(tokenizers, kind):
    tok = tokenizers[kind]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.kind == kind
    ids = tok.encode("小明打小红")
    assert tok.decode([1, *ids, 2, 0, 0, 3]) == "小明打小红"
    assert tok.decode([tok.vocab_size, tok.vocab_size + 7, -1]) == ""  # outside the vocabulary: skipped


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_encode_batch_equals_encode(tokenizers, kind):
    tok = tokenizers[kind]
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_char_vocabulary_is_sorted_characters_and_unknown_is_unk():
    tok = train_tokenizer("char", ["cab", "bca"])
    assert tok.chars == ["a", "b", "c"] and tok.vocab_size == 7
    assert tok.encode("abcz") == [4, 5, 6, 3]
    assert tok.decode(tok.encode("abzc")) == "abc"  # unk is a special: decode skips it
    chinese = train_tokenizer("char", "小明打小红")  # one string is one text
    assert chinese.encode("小红打小明") == [4 + chinese.chars.index(c) for c in "小红打小明"]
    assert chinese.vocab_size == 4 + 4


def test_char_vocab_size_keeps_the_most_frequent_characters():
    tok = train_tokenizer("char", ["aaaabbbcc", "d"], vocab_size=6)
    assert tok.chars == ["a", "b"]
    assert tok.encode("abcd") == [4, 5, 3, 3]


def test_byte_ids_are_utf8_bytes_plus_four():
    tok = ByteTokenizer()
    assert tok.vocab_size == 260
    assert tok.encode("Aé") == [0x41 + 4, 0xC3 + 4, 0xA9 + 4]
    assert tok.encode("小") == [b + 4 for b in "小".encode()]
    assert tok.decode(tok.encode("小")[:2]) == "\ufffd"  # a cut character decodes to U+FFFD, not an error


def test_bpe_learns_merges_and_puts_specials_first(tokenizers):
    tok = tokenizers["bpe"]
    assert 260 < tok.vocab_size <= 400
    assert [tok.hf.id_to_token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    text = "The quick brown fox jumps over the lazy dog."
    assert len(tok.encode(text)) < len(text.encode()) / 2  # merges: 17 tokens for 44 bytes (tokenizers 0.23)


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_save_and_load_give_identical_encodings(tokenizers, kind, tmp_path):
    tok = tokenizers[kind]
    path = tok.save(tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    if kind != "bpe":
        assert data["blockformer_tokenizer"] == kind
    for loaded in (load_tokenizer(tmp_path / "ckpt"), load_tokenizer(path)):
        assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
        assert loaded.fingerprint() == tok.fingerprint()
        assert [loaded.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]


def test_fingerprint_is_stable_and_tells_vocabularies_apart(tokenizers):
    assert ByteTokenizer().fingerprint() == "c2036c6ef4922ca1"  # a format change would orphan checkpoints
    assert CharTokenizer("abc").fingerprint() == CharTokenizer("cba").fingerprint()
    assert CharTokenizer("abc").fingerprint() != CharTokenizer("abd").fingerprint()
    other = train_tokenizer("bpe", ["something else entirely " * 50], vocab_size=300)
    assert other.fingerprint() != tokenizers["bpe"].fingerprint()
    assert len({t.fingerprint() for t in tokenizers.values()}) == 3


def _hf_bpe(special_tokens: list[str]) -> HFTokenizer:
    """A byte-level BPE trained by `tokenizers` directly, specials in the given order."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS, trainer=trainer)
    return hf


@pytest.mark.parametrize(
    "specials, hf_ids_of_ours",
    [
        (["<s>", "<pad>", "</s>", "<unk>"], [1, 0, 2, 3]),  # RoBERTa's order
        (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], [0, 2, 3, 1]),  # BERT's names and order
    ],
)
def test_load_hf_tokenizer_json_moves_specials_to_0_to_3(tmp_path, specials, hf_ids_of_ours):
    hf = _hf_bpe(specials)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    hf.encode_special_tokens = True  # as blockformer reads text: "[SEP]" in a text is text
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == hf.get_vocab_size()
    assert [int(tok._to_hf[i]) for i in range(4)] == hf_ids_of_ours
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        hf_ids = hf.encode(text, add_special_tokens=False).ids
        assert [int(tok._to_hf[i]) for i in ids] == hf_ids  # the same tokens, renumbered
    assert min(tok.encode("[SEP] </s> [MASK]")) >= 4  # special names in the text stay text
    assert tok.decode([0, 1, 2, 3] + tok.encode("ok")) == "ok"


def test_load_hf_tokenizer_without_specials_names_the_file(tmp_path):
    hf = _hf_bpe(["<|endoftext|>"])  # GPT-2 style: no pad or unk
    path = tmp_path / "gpt2ish.json"
    hf.save(str(path))
    with pytest.raises(UsageError, match=r"gpt2ish\.json: tokenizer has no pad token"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "tokenizer not found"),
        ("", "empty file"),
        ("{not json", "invalid JSON"),
        ('{"a": 1}', "not a tokenizer the `tokenizers` package can read"),
    ],
)
def test_bad_tokenizer_files_raise_usage_error_naming_them(tmp_path, content, message):
    path = tmp_path / "bad" / "tokenizer.json"
    path.parent.mkdir()
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message) as info:
        load_tokenizer(path.parent)
    assert str(path) in str(info.value)


def test_bad_kinds_and_sizes_raise_usage_error():
    with pytest.raises(UsageError, match="tokenizer.kind: unknown kind 'word'"):
        train_tokenizer("word", ["x"])
    with pytest.raises(UsageError, match="tokenizer.vocab_size: 100 is too small"):
        train_tokenizer("bpe", ["x"], vocab_size=100)
    with pytest.raises(UsageError, match="tokenizer.vocab_size: 300 for a byte tokenizer"):
        train_tokenizer("byte", ["x"], vocab_size=300)


def test_a_tokenizer_json_that_pads_and_truncates_encodes_only_the_text(tmp_path):
    # all-MiniLM-L6-v2's tokenizer.json pads every text to 128 ids; blockformer batches itself.
    hf = HFTokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "a": 4}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.enable_padding(length=16, pad_id=0)
    hf.enable_truncation(max_length=3)
    hf.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("a a a a a") == [4] * 5
