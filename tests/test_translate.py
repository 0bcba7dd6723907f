"""`blockformer translate` and `blockformer eval --src --ref`: exact outputs of a tiny model
trained on the reverse task, BLEU 100 on it, input order kept through length-sorted
batches, n-best lines, length limits, and one-line errors."""

import dataclasses
import io
import json
import math

import pytest
import torch

from blockformer import build_model
from blockformer.cli import main
from blockformer.cli.translate import translate_nbest, translate_texts
from blockformer.generate import beam_search, greedy_decode
from blockformer.run_config import load_run_config
from blockformer.tokenizers import EOS_ID, CharTokenizer, train_tokenizer
from blockformer.train import load_checkpoint, save_checkpoint, train

# Reversal of 3-6 letters (a-j), learnt to 100% held-out exact match in 300 steps (~5-10 s).
REVERSE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=256", "data.task_max_len=6",
           "data.heldout=100", "train.steps=300", "train.lr=3e-3", "train.warmup=30", "train.batch_size=64",
           "train.eval_every=0", "train.eval_samples=100", "train.progress=false"]
SOURCES = ["abc", "jihgf", "decaf", "bad", "hhij", "gabbj"]


@pytest.fixture(scope="module")
def reverse_ckpt(tmp_path_factory):
    cfg = load_run_config(preset="reverse", overrides=REVERSE)
    result = train(cfg, tmp_path_factory.mktemp("reverse") / "run", log=lambda *a: None)
    assert result.val["exact_match"] == 1.0  # the premise of the exact-output tests below
    return str(result.checkpoint)


def _random_ckpt(tmp_path, arch="encoder-decoder"):
    """An untrained checkpoint (seed 0) with a char tokenizer over a-j. Large random weights
    and a damped eos logit make its outputs long and different for different inputs."""
    overrides = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64"]
    if arch == "encoder-decoder":
        cfg = load_run_config(preset="reverse", overrides=[*overrides, "model.init_std=0.3", "model.tie_embeddings=false"])
        tok = CharTokenizer("abcdefghij")
    else:
        cfg = load_run_config(overrides=[*overrides, "data.tokenizer=byte", "model.vocab_size=260"])
        tok = train_tokenizer("byte", [])
    model = build_model(cfg.model, seed=0)
    if arch == "encoder-decoder":
        with torch.no_grad():
            model.head.weight[EOS_ID] *= 0.5
    return save_checkpoint(tmp_path / arch, model, tok, cfg), model, tok


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.mark.slow
def test_translate_file_reverses_exactly_with_beam_and_greedy(reverse_ckpt, tmp_path, capsys):
    src = _write(tmp_path / "in.txt", SOURCES)
    for beam in ("4", "1"):
        out = tmp_path / f"out{beam}.txt"
        assert main(["translate", "--checkpoint", reverse_ckpt, "--input", src, "--output", str(out),
                     "--beam", beam, "--batch-size", "4"]) == 0
        assert out.read_text(encoding="utf-8").splitlines() == [s[::-1] for s in SOURCES]
    err = capsys.readouterr().err
    assert "translate" in err and f"{len(SOURCES)}/{len(SOURCES)}" in err  # the progress bar, on files


@pytest.mark.slow
def test_translate_stdin_to_stdout_without_progress_bar(reverse_ckpt, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("abc\n\ndecaf\n"))
    assert main(["translate", "--checkpoint", reverse_ckpt]) == 0
    captured = capsys.readouterr()
    assert captured.out == "cba\n\nfaced\n"  # a blank line stays a blank line
    assert "sent" not in captured.err


@pytest.mark.slow
def test_eval_scores_bleu_100_and_chrf_100_against_reversed_references(reverse_ckpt, tmp_path, capsys):
    src, ref = _write(tmp_path / "src.txt", SOURCES), _write(tmp_path / "ref.txt", [s[::-1] for s in SOURCES])
    # Each output is one "word"; 13a BLEU needs 4-grams of words, so score characters here.
    assert main(["eval", "--checkpoint", reverse_ckpt, "--src", src, "--ref", ref, "--tokenize", "char", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["bleu"] == pytest.approx(100.0) and metrics["chrf"] == pytest.approx(100.0)
    assert metrics["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:char|smooth:exp|version:")
    assert metrics["sentences"] == len(SOURCES) and metrics["beam"] == 4

    wrong = _write(tmp_path / "wrong.txt", SOURCES)  # the unreversed sources as references
    assert main(["eval", "--checkpoint", reverse_ckpt, "--src", src, "--ref", wrong, "--tokenize", "char"]) == 0
    out = capsys.readouterr().out
    assert "BLEU " in out and "tok:char" in out and "chrF2 " in out and "nc:6" in out
    assert out.startswith("BLEU  ") and out.splitlines()[1].split()[0].count("/") == 3  # n-gram precisions
    assert float(out.split()[1]) < 60


@pytest.mark.slow
def test_max_len_and_n_best(reverse_ckpt, tmp_path, capsys):
    src = _write(tmp_path / "in.txt", ["abcdef"])
    out = tmp_path / "out.txt"
    assert main(["translate", "--checkpoint", reverse_ckpt, "--input", src, "--output", str(out),
                 "--max-len-b", "3", "--quiet"]) == 0
    assert out.read_text() == "fed\n"  # 3 tokens, cut before eos
    assert capsys.readouterr().err == ""  # --quiet: no progress bar
    assert main(["translate", "--checkpoint", reverse_ckpt, "--input", src, "--n-best", "3", "--beam", "3"]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [idx for idx, _, _ in lines] == ["0", "0", "0"] and lines[0][2] == "fedcba"
    scores = [float(s) for _, s, _ in lines]
    assert scores == sorted(scores, reverse=True) and scores[0] > -0.1 and len({t for *_, t in lines}) == 3


def test_batches_sorted_by_length_come_back_in_input_order(tmp_path):
    path, model, tok = _random_ckpt(tmp_path)
    texts = ["abcdefgh", "a", "", "jihg", "abcdefghijabcdefghij", "bb", "cdcdcd"]
    for beam in (1, 3):
        alone = []
        for t in texts:  # each sentence decoded on its own, straight from the library
            if not t:
                alone.append("")
                continue
            ids = [tok.encode(t) + [EOS_ID]]
            out = greedy_decode(model, ids, max_len=12) if beam == 1 else [
                beam_search(model, ids, beam_size=beam, max_len=12)[0][0].tokens]
            alone.append(tok.decode(out[0]))
        for batch_size in (1, 2, 3, 64):
            got = translate_texts(model, tok, texts, beam_size=beam, max_len_b=12, batch_size=batch_size)
            assert got == alone, (beam, batch_size)
        assert len(set(alone)) == len(texts)  # all different, so a reordering would show


def test_nbest_scores_and_progress_counts(tmp_path):
    _, model, tok = _random_ckpt(tmp_path)
    seen = []
    hyps = translate_nbest(model, tok, ["abc", "", "defgh"], beam_size=3, n_best=3, max_len_b=6, batch_size=1,
                           progress=seen.append)
    assert sum(seen) == 3 and [len(h) for h in hyps] == [3, 1, 3]
    assert hyps[1] == [("", 0.0)]
    for h in (hyps[0], hyps[2]):
        assert [s for _, s in h] == sorted((s for _, s in h), reverse=True)
    [greedy] = translate_nbest(model, tok, ["abc"], beam_size=1, max_len_b=6)
    assert math.isnan(greedy[0][1])  # greedy has no length-normalised score


def test_translate_cli_matches_library(tmp_path, capsys):
    path, model, tok = _random_ckpt(tmp_path)
    src = _write(tmp_path / "in.txt", ["abc", "ddee", "j"])
    assert main(["translate", "--checkpoint", str(path), "--input", src, "--beam", "2", "--max-len-b", "7"]) == 0
    expected = translate_texts(load_checkpoint(path).model, tok, ["abc", "ddee", "j"], beam_size=2, max_len_b=7)
    assert capsys.readouterr().out.splitlines() == expected


def test_translate_cli_keeps_its_cache_in_the_dtype_asked_for(tmp_path, capsys, monkeypatch):
    """``--kv-cache-dtype fp16``: the decoder's cache holds fp16, beam or greedy, and the output is the
    library's with the same option."""
    from blockformer.nn.kv_cache import KVCache

    path, model, tok = _random_ckpt(tmp_path)
    src = _write(tmp_path / "in.txt", ["abc", "ddee", "j"])
    held, update = set(), KVCache.update
    monkeypatch.setattr(KVCache, "update", lambda self, *a: held.add(self.dtype) or update(self, *a))
    for beam in ("2", "1"):
        assert main(["translate", "--checkpoint", str(path), "--input", src, "--beam", beam, "--max-len-b", "7",
                     "--kv-cache-dtype", "fp16"]) == 0
        expected = translate_texts(load_checkpoint(path).model, tok, ["abc", "ddee", "j"], beam_size=int(beam),
                                   max_len_b=7, kv_cache_dtype="fp16")
        assert capsys.readouterr().out.splitlines() == expected
    assert held == {torch.float16}
    assert main(["translate", "--checkpoint", str(path), "--input", src, "--kv-cache-dtype", "int4"]) == 2
    assert "--kv-cache-dtype: invalid choice: 'int4'" in capsys.readouterr().err


def test_decoder_checkpoint_is_a_usage_error(tmp_path, capsys):
    path, _, _ = _random_ckpt(tmp_path, arch="decoder")
    src = _write(tmp_path / "in.txt", ["hello"])
    assert main(["translate", "--checkpoint", str(path), "--input", src]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blockformer translate: error: --checkpoint") and "needs an encoder-decoder" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n-best", "3", "--beam", "2"], "--n-best 3: expected an integer in [1, --beam=2]"),
        (["--beam", "0"], "--beam 0: expected an integer in [1, 1024]"),
        (["--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
        (["--alpha", "-1"], "--alpha -1.0: expected a finite float >= 0"),
        (["--input", "missing.txt"], "missing.txt: no such file"),
    ],
)
def test_bad_options_exit_2_with_one_line(tmp_path, capsys, monkeypatch, args, message):
    path, _, _ = _random_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("abc\n"))
    assert main(["translate", "--checkpoint", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_eval_reference_length_mismatch_is_a_usage_error(tmp_path, capsys):
    path, _, _ = _random_ckpt(tmp_path)
    src, ref = _write(tmp_path / "s.txt", ["abc", "de"]), _write(tmp_path / "r.txt", ["cba"])
    assert main(["eval", "--checkpoint", str(path), "--src", src, "--ref", ref]) == 2
    assert "r.txt: 1 lines but" in capsys.readouterr().err


def test_bf16_translation_keeps_order_and_agrees_with_fp32(tmp_path):
    """16 sources of lengths 1-11 (one blank), beam 2. Batched bf16 output, sorted by length
    and restored, must match each sentence translated alone (a misordering would swap whole
    lines: 16/16 agree here, >= 14 required), and fp32 (15/16 here: bf16 rounding can flip a
    close beam choice; >= 12 required)."""
    _, model, tok = _random_ckpt(tmp_path)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 12, (16,), generator=g).tolist()
    texts = ["".join("abcdefghij"[i] for i in torch.randint(10, (n,), generator=g).tolist()) for n in lengths]
    texts[3] = ""
    options = dict(beam_size=2, max_len_b=12)
    fp32 = translate_texts(model, tok, texts, **options)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batched = translate_texts(model, tok, texts, **options)
        alone = [translate_texts(model, tok, [t], **options)[0] for t in texts]
    assert batched[3] == "" and all(len(o) <= 12 for o in batched)
    assert sum(a == b for a, b in zip(batched, alone)) >= 14
    assert sum(a == b for a, b in zip(batched, fp32)) >= 12


def test_translate_small_preset_trains_a_shared_vocabulary_translator(tmp_path):
    cfg = load_run_config(preset="translate-small")
    m, d, t = cfg.model, cfg.data, cfg.train
    assert (m.arch, m.tie_embeddings, m.src_vocab_size, m.scale_embeddings) == ("encoder-decoder", True, None, True)
    assert (d.tokenizer, t.label_smoothing, t.schedule, t.beta2, t.precision) == ("bpe", 0.1, "noam", 0.98, "auto")
    assert t.keep_last >= 5 and t.max_tokens > 0
    de = ["ein Hund läuft", "eine Frau singt", "zwei Männer lachen", "ein Kind spielt"] * 5
    en = ["a dog runs", "a woman sings", "two men laugh", "a child plays"] * 5
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "data.vocab_size=300",
            "train.steps=2", "train.warmup=1", "train.max_tokens=64", "train.progress=false",
            f"data.src={_write(tmp_path / 'train.de', de)}", f"data.tgt={_write(tmp_path / 'train.en', en)}"]
    result = train(load_run_config(preset="translate-small", overrides=tiny), tmp_path / "run", log=lambda *a: None)
    ckpt = load_checkpoint(result.checkpoint)
    assert ckpt.tokenizer.kind == "bpe" and ckpt.tokenizer.vocab_size <= 300
    # One joint vocabulary: source embedding, target embedding and output layer are one matrix.
    model = ckpt.model
    assert model.src_embed.tokens.weight is model.tgt_embed.tokens.weight is model.head.weight
    [out] = translate_texts(model, ckpt.tokenizer, ["ein Hund singt"], beam_size=2, max_len_b=4)
    [[best]] = beam_search(model, [ckpt.tokenizer.encode("ein Hund singt") + [EOS_ID]], beam_size=2, max_len=4)
    assert len(best.tokens) <= 4 and out == ckpt.tokenizer.decode(best.tokens)


def test_the_fp32_translation_preset_is_translate_small_with_a_schedule_that_fits_700_steps():
    small, fp32 = load_run_config(preset="translate-small"), load_run_config(preset="translate-small-fp32")
    assert dataclasses.replace(fp32.model, dropout=0.2, attention_dropout=0.1) == small.model  # the same model
    assert (fp32.model.dropout, fp32.model.attention_dropout) == (0.1, 0.0)
    assert fp32.data == small.data
    differ = {f.name for f in dataclasses.fields(small.train) if getattr(small.train, f.name) != getattr(fp32.train, f.name)}
    assert differ == {"name", "steps", "warmup", "eval_every"}  # the same batches, optimizer and noam factor
    assert (fp32.train.steps, fp32.train.warmup, fp32.train.precision) == (700, 200, "auto")
