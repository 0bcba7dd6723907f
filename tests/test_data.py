"""Data: text sources, the cached token file, LM windows, seq2seq batches and the synthetic tasks."""

import gzip

import numpy as np
import pytest
import torch

from blockformer.data import (
    LMDataset,
    TaskBatches,
    TokenBatcher,
    TokenFile,
    build_token_file,
    collate_pairs,
    encode_pairs,
    exact_match,
    iter_texts,
    make_task,
    read_pairs,
    stdlib_dir,
)
from blockformer.data import sources, token_file
from blockformer.errors import UsageError
from blockformer.tokenizers import ByteTokenizer, CharTokenizer, train_tokenizer

DOCS = ["first document\nline two\n", "小明打小红\n", "third: 😀 end"]


@pytest.fixture
def corpus(tmp_path):
    """A directory of three documents (one gzipped, one nested), plus files that must be skipped."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(DOCS[0], encoding="utf-8")
    with gzip.open(root / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write(DOCS[1])
    (root / "sub" / "c.md").write_text(DOCS[2], encoding="utf-8")
    (root / "empty.txt").write_text("")
    (root / ".hidden").write_text("secret")
    (root / "image.bin").write_bytes(b"\x89PNG\0\0\0binary")
    return root


# ---- sources ----


def test_directory_glob_file_and_list_sources_read_exact_text(corpus):
    assert list(iter_texts(corpus)) == DOCS  # sorted walk; .gz read directly; empty/hidden/binary skipped
    assert list(iter_texts(str(corpus / "*.txt*"))) == DOCS[:2]
    assert list(iter_texts(str(corpus / "**" / "*.md"))) == DOCS[2:]
    assert list(iter_texts(corpus / "b.txt.gz")) == [DOCS[1]]
    assert list(iter_texts([corpus / "sub" / "c.md", str(corpus / "a.txt")])) == [DOCS[2], DOCS[0]]


def test_large_files_are_read_in_pieces_but_yield_whole_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_CHARS", 7)
    text = "".join(f"line {i} 小明\n" for i in range(50))
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    pieces = list(sources.iter_pieces(tmp_path / "big.txt"))
    assert len(pieces) == 50 and all(p.endswith("\n") for p, _ in pieces)  # cut at line ends
    assert [starts for _, starts in pieces] == [True] + [False] * 49
    assert list(iter_texts(tmp_path / "big.txt")) == [text]


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.txt", "missing.txt: no such file or directory"),
    (lambda d: d / "*.nothing", r"glob .*\*\.nothing: matched no non-empty text files"),
    (lambda d: d / "empty.txt", "empty.txt: empty file"),
    (lambda d: d / "latin1.txt", "latin1.txt: not valid UTF-8"),
])
def test_bad_sources_raise_usage_error_naming_them(corpus, make, message):
    (corpus / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UsageError, match=message):
        list(iter_texts(make(corpus)))


def test_stdlib_corpus_is_deterministic_capped_and_skips_tests():
    files = [p for p, origin in sources.resolve("stdlib") if origin == "stdlib"]
    assert len(files) > 100 and all(p.suffix == ".py" for p in files)
    parts = {part for p in files for part in p.relative_to(stdlib_dir()).parts[:-1]}
    assert not parts & {"test", "tests", "site-packages"}
    first = list(iter_texts("stdlib", max_bytes=200_000))
    assert first == list(iter_texts("stdlib", max_bytes=200_000))
    size = sum(len(t.encode()) for t in first)
    assert 150_000 < size <= 200_000 and first[-1].endswith("\n")
    assert first[0] == files[0].read_text(encoding="utf-8")


# ---- token file ----


class CountingTokenizer(CharTokenizer):
    calls = 0

    def encode_batch(self, texts):
        CountingTokenizer.calls += 1
        return super().encode_batch(texts)


def test_token_file_joins_documents_with_eos_and_matches_direct_encoding(corpus, tmp_path):
    tok = train_tokenizer("char", DOCS)
    tf = TokenFile(build_token_file(corpus, tok, tmp_path / "cache"))
    expected = tok.encode(DOCS[0]) + [2] + tok.encode(DOCS[1]) + [2] + tok.encode(DOCS[2])
    assert tf.tokens.dtype == np.uint16 and isinstance(tf.tokens, np.memmap)
    assert tf.tokens.tolist() == expected and len(tf) == len(expected)
    assert (tf.vocab_size, tf.fingerprint) == (tok.vocab_size, tok.fingerprint())
    # In-memory documents (any non-list iterable) give the same file.
    assert build_token_file(iter(DOCS), tok, tmp_path / "cache") == tf.path


def test_token_file_pieces_do_not_change_byte_tokens(tmp_path, monkeypatch):
    text = "".join(f"row {i}: 小明打小红\n" for i in range(300))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(sources, "PIECE_CHARS", 64)
    monkeypatch.setattr(token_file, "BATCH_CHARS", 200)
    tf = TokenFile(build_token_file(tmp_path / "t.txt", ByteTokenizer(), tmp_path / "cache"))
    assert tf.tokens.tolist() == ByteTokenizer().encode(text)


def test_token_file_is_cached_by_content_and_tokenizer(corpus, tmp_path):
    tok = CountingTokenizer("".join(DOCS))
    cache = tmp_path / "cache"
    path = build_token_file(corpus, tok, cache)
    calls, mtime = CountingTokenizer.calls, path.stat().st_mtime_ns
    assert calls >= 1
    assert build_token_file(corpus, tok, cache) == path  # reused: not tokenised, not rewritten
    assert CountingTokenizer.calls == calls and path.stat().st_mtime_ns == mtime
    (corpus / "a.txt").write_text("changed\n")
    assert build_token_file(corpus, tok, cache) != path
    assert build_token_file(corpus, ByteTokenizer(), cache) not in (path,)
    assert sorted(p.suffix for p in cache.iterdir()) == [".bin"] * 3  # no temporary files left


def test_token_file_crash_leaves_no_file(corpus, tmp_path):
    class Failing(CharTokenizer):
        def encode_batch(self, texts):
            raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        build_token_file(corpus, Failing("abc"), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_token_dtype_and_bad_token_file(tmp_path):
    assert token_file.token_dtype(65535) == np.uint16 and token_file.token_dtype(65536) == np.uint32
    (tmp_path / "x.bin").write_bytes(b"not tokens at all")
    with pytest.raises(UsageError, match="x.bin: not a blockformer token file"):
        TokenFile(tmp_path / "x.bin")


# ---- language-modelling windows ----


def test_lm_split_sizes_and_shift():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = LMDataset(tokens, 16, "train"), LMDataset(tokens, 16, "val")
    assert (len(train), len(val)) == (900, 100)
    x, y = train.sample(8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(y, x + 1) and int(x.max()) < 899
    x, y = val.sample(8, torch.Generator().manual_seed(0))
    assert int(x.min()) >= 900 and int(y.max()) <= 999


def test_lm_sampling_depends_only_on_the_generator():
    ds = LMDataset(np.arange(5000), 32, "train")
    g = torch.Generator().manual_seed(7)
    first = ds.sample(4, g)
    state = g.get_state()
    second = ds.sample(4, g)
    g2 = torch.Generator()
    g2.set_state(state)  # what a resumed trainer does
    assert torch.equal(ds.sample(4, g2)[0], second[0])
    assert not torch.equal(first[0], second[0])


def test_lm_eval_batches_are_fixed_non_overlapping_windows():
    ds = LMDataset(np.arange(1000), 10, "val", val_fraction=0.5)  # tokens 500..999
    batches = list(ds.eval_batches(4))
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == [500 + 10 * i for i in range(49)]  # (500 - 1) // 10 windows
    few = [x[:, 0].tolist() for x, _ in ds.eval_batches(4, max_batches=2)]
    assert few == [[500, 560, 620, 680], [740, 800, 860, 920]]  # spread over the split
    assert few == [x[:, 0].tolist() for x, _ in ds.eval_batches(4, max_batches=2)]


def test_lm_too_short_split_names_the_sizes():
    with pytest.raises(UsageError, match="the val split has 10 tokens, fewer than seq_len \\+ 1 = 17"):
        LMDataset(np.arange(100), 16, "val")


# ---- sequence to sequence ----


def test_read_pairs_plain_and_gz(tmp_path):
    (tmp_path / "s.txt").write_text("ein Haus\r\nzwei\n", encoding="utf-8")
    with gzip.open(tmp_path / "t.txt.gz", "wt", encoding="utf-8") as f:
        f.write("a house\ntwo")
    assert read_pairs(tmp_path / "s.txt", tmp_path / "t.txt.gz") == [("ein Haus", "a house"), ("zwei", "two")]
    (tmp_path / "u.txt").write_text("one\ntwo\nthree\n")
    with pytest.raises(UsageError, match=r"s\.txt has 2 lines but .*u\.txt has 3"):
        read_pairs(tmp_path / "s.txt", tmp_path / "u.txt")
    with pytest.raises(UsageError, match="nope.txt: no such file"):
        read_pairs(tmp_path / "s.txt", tmp_path / "nope.txt")


def test_collate_adds_specials_pads_and_masks():
    batch = collate_pairs([([5, 6, 7], [8]), ([9], [10, 11, 12])])
    assert batch.src.tolist() == [[5, 6, 7, 2], [9, 2, 0, 0]]
    assert batch.src_mask.tolist() == [[True] * 4, [True, True, False, False]]
    assert batch.tgt_in.tolist() == [[1, 8, 0, 0], [1, 10, 11, 12]]
    assert batch.tgt_out.tolist() == [[8, 2, 0, 0], [10, 11, 12, 2]]
    assert batch.tgt_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert batch.num_tokens == 6 and len(batch) == 2
    moved = batch.to("cpu")
    assert moved.num_tokens == 6 and torch.equal(moved.tgt_out, batch.tgt_out)
    assert moved.src_mask.dtype == torch.bool


def _random_pairs(n=400, seed=0):
    rng = np.random.default_rng(seed)
    def ids():
        return rng.integers(4, 50, rng.integers(1, 30)).tolist()

    return [(ids(), ids()) for _ in range(n)]


def test_batcher_respects_max_tokens_and_covers_every_pair_once():
    pairs = _random_pairs()
    batcher = TokenBatcher(pairs, max_tokens=200, seed=3)
    seen = []
    for batch, index in zip(batcher.batches(0), batcher.batch_indices(0)):
        assert len(batch) * batch.src.shape[1] <= 200 and len(batch) * batch.tgt_in.shape[1] <= 200
        assert batch.num_tokens == sum(len(pairs[i][1]) + 1 for i in index)
        seen.extend(index.tolist())
    assert sorted(seen) == list(range(len(pairs)))
    assert batcher.state_dict()["epoch"] == 1  # a finished epoch moves on


def test_batcher_buckets_by_length_to_cut_padding():
    batcher = TokenBatcher(_random_pairs(), max_tokens=200)
    lengths = batcher.lengths

    def padding(batches):  # share of padded positions, in the B * max_len the batcher budgets
        return 1 - sum(lengths[b].sum() for b in batches) / sum(len(b) * lengths[b].max() for b in batches)

    unsorted, start = [], 0  # the same greedy packing in shuffled order, without sorting
    order = np.random.default_rng(0).permutation(len(lengths))
    for j in range(len(order)):
        if (j - start + 1) * lengths[order[start : j + 1]].max() > 200:
            unsorted.append(order[start:j])
            start = j
    unsorted.append(order[start:])
    bucketed = padding(batcher.batch_indices(0))
    assert bucketed < 0.05 and padding(unsorted) > 0.2  # 0.019 and 0.26 here


def test_batcher_is_deterministic_per_seed_and_epoch():
    pairs = _random_pairs()
    same = [[i.tolist() for i in TokenBatcher(pairs, 200, seed=1).batch_indices(2)] for _ in range(2)]
    assert same[0] == same[1]
    other = TokenBatcher(pairs, 200, seed=1).batch_indices(3)
    assert [i.tolist() for i in other] != same[0]


def test_batcher_resumes_mid_epoch_and_across_epochs_with_the_identical_batch():
    pairs = _random_pairs()
    reference = TokenBatcher(pairs, 200, seed=5).stream()
    expected = [next(reference) for _ in range(100)]  # spans more than one epoch
    n_epoch = TokenBatcher(pairs, 200, seed=5).num_batches(0)
    assert n_epoch < 90
    for stop in (3, n_epoch - 1, n_epoch, n_epoch + 2):
        first = TokenBatcher(pairs, 200, seed=5)
        stream = first.stream()
        for _ in range(stop):
            next(stream)
        resumed = TokenBatcher(pairs, 200, seed=5)
        resumed.load_state_dict(first.state_dict())
        batch = next(resumed.stream())
        assert torch.equal(batch.src, expected[stop].src)
        assert torch.equal(batch.tgt_out, expected[stop].tgt_out)


def test_batcher_max_len_drops_or_clips_and_checks_max_tokens():
    pairs = [([4] * 3, [5] * 3), ([4] * 10, [5] * 2), ([4] * 2, [5] * 12)]
    assert TokenBatcher(pairs, 100, max_len=5).num_dropped == 2
    clipped = TokenBatcher(pairs, 100, max_len=5, overlong="clip")
    assert clipped.num_dropped == 0 and clipped.lengths.tolist() == [4, 6, 6]
    with pytest.raises(UsageError, match=r"batch.max_tokens: 10 is below the longest pair \(13 tokens\)"):
        TokenBatcher(pairs, 10)
    with pytest.raises(UsageError, match="resume: the batcher state is for 3 pairs"):
        TokenBatcher(pairs[:2], 100).load_state_dict(TokenBatcher(pairs, 100).state_dict())


# ---- synthetic tasks ----


@pytest.mark.parametrize("name, rule", [
    ("copy", lambda s: s),
    ("reverse", lambda s: s[::-1]),
    ("sort", lambda s: "".join(sorted(s))),
])
def test_sequence_tasks_compute_their_targets(name, rule):
    task = make_task(name, min_len=2, max_len=6)
    g = torch.Generator().manual_seed(0)
    pairs = [task.sample(g) for _ in range(200)]
    assert all(tgt == rule(src) for src, tgt in pairs)
    assert {len(src) for src, _ in pairs} == {2, 3, 4, 5, 6}
    assert set("".join(src for src, _ in pairs)) <= set(task.alphabet)


def test_add_task_adds():
    task = make_task("add", digits=3)
    g = torch.Generator().manual_seed(0)
    for src, tgt in [task.sample(g) for _ in range(200)]:
        a, b = src.split("+")
        assert int(tgt) == int(a) + int(b) and max(int(a), int(b)) < 1000
        assert len(a) == len(b) == 3  # zero-padded to a fixed width
    assert task.target("007+045") == "52"
    assert task.target("123+456") == "579" and task.target("999+1") == "1000"
    assert task.alphabet == "0123456789+"


def test_heldout_split_is_fixed_and_never_sampled_for_training():
    a, b = make_task("reverse", n_heldout=100), make_task("reverse", n_heldout=100)
    assert a.heldout() == b.heldout() and len(set(a.heldout())) == 100
    assert a.heldout(10) == a.heldout()[:10]
    assert make_task("reverse", max_len=8, n_heldout=100).heldout() != a.heldout()
    # A tiny space (30 sources, 15 held out): training must see exactly the other 15.
    tiny = make_task("copy", min_len=1, max_len=4, alphabet="ab", n_heldout=15)
    held = {s for s, _ in tiny.heldout()}
    g = torch.Generator().manual_seed(0)
    trained = {tiny.sample(g)[0] for _ in range(600)}
    assert not trained & held and len(trained) == 15 and len(held) == 15


def test_task_errors_are_usage_errors():
    with pytest.raises(UsageError, match="task: unknown task 'mul'"):
        make_task("mul")
    with pytest.raises(UsageError, match="task.add: options \\['max_len'\\]"):
        make_task("add", max_len=3)
    with pytest.raises(UsageError, match="task.n_heldout: 20 for 30 possible copy sources"):
        make_task("copy", min_len=1, max_len=4, alphabet="ab", n_heldout=20)


def test_exact_match():
    assert exact_match(["abc", "x", "12 "], ["abc", "y", "12"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        exact_match(["a"], [])


def test_task_batches_go_through_the_char_tokenizer_and_resume_from_the_generator():
    task = make_task("reverse", min_len=3, max_len=5)
    tok = task.char_tokenizer()
    batches = TaskBatches(task, tok, batch_size=8)
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    batch = batches.sample(g)
    for b in range(8):
        src = tok.decode(batch.src[b].tolist())
        assert tok.decode(batch.tgt_out[b].tolist()) == src[::-1]
        assert int(batch.src_mask[b].sum()) == len(src) + 1
    g.set_state(state)
    assert torch.equal(batches.sample(g).src, batch.src)
    held = list(batches.heldout_batches(20))
    assert [len(b) for b in held] == [8, 8, 4]
    decoded = [tok.decode(row.tolist()) for b in held for row in b.src]
    assert decoded == [s for s, _ in task.heldout(20)]
    assert encode_pairs([("ab", "ba")], tok) == [([4, 5], [5, 4])]
