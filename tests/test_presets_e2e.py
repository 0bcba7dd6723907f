"""Every preset's end-to-end path exits 0: train (a few steps of a shrunken model, keeping
the preset's positions, lengths and samples), then the commands its report suggests.
char-lm-tiny once ended its own run with exit 2: its samples asked a learned position
table of 64 for 200 tokens."""

import shlex

import pytest

from blockformer.cli import main
from blockformer.run_config import preset_names

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.steps=2",
         "train.progress=false", "train.eval_batches=2"]
EXTRA = {
    "add": ["data.heldout=20", "train.eval_samples=10", "train.batch_size=16"],
    "copy": ["data.heldout=20", "train.eval_samples=10", "train.batch_size=16"],
    "reverse": ["data.heldout=20", "train.eval_samples=10", "train.batch_size=16"],
    "sort": ["data.heldout=20", "train.eval_samples=10", "train.batch_size=16"],
    "char-lm-tiny": ["data.text={corpus}", "train.batch_size=4"],  # keeps sample_tokens=200 > max_seq_len=64
    "stdlib-lm": ["data.max_bytes=300000", "train.batch_size=4", "train.sample_tokens=150"],
    "translate-small": ["data.src={src}", "data.tgt={tgt}", "data.vocab_size=300", "train.max_tokens=400"],
    "translate-small-fp32": ["data.src={src}", "data.tgt={tgt}", "data.vocab_size=300", "train.max_tokens=400"],
    "original-base": ["data.src={src}", "data.tgt={tgt}", "data.vocab_size=300", "train.max_tokens=400"],
    "stdlib-mlm": ["data.text={corpus}", "train.batch_size=4"],
    "stdlib-packages": ["data.labels={labels}", "data.val_labels={labels}", "train.batch_size=4"],
    "llama-1b": ["data.text={corpus}", "data.vocab_size=300", "data.seq_len=32", "model.max_seq_len=256",
                 "model.n_kv_heads=1", "train.batch_size=4", "train.sample_tokens=20"],
    "llama-7b": ["data.text={corpus}", "data.vocab_size=300", "data.seq_len=32", "model.max_seq_len=256",
                 "model.n_kv_heads=2", "train.batch_size=4", "train.sample_tokens=20"],
    "digits-vit": ["train.batch_size=8"],
    "digits-to-text": ["data.heldout=10", "train.eval_samples=10", "train.batch_size=8"],
    "vowels-frames": ["train.batch_size=8"],  # sktime, in the [test] extra
}


def _files(tmp_path) -> dict:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"To be, or not to be: line {i} of the play.\n" for i in range(300)))
    words = ["a cat", "the dog", "a red ball", "two birds", "the old man", "a small house"]
    src = [f"{w} is {v}" for w in words for v in ("here", "there", "big", "small", "green")] * 4
    (tmp_path / "p.src").write_text("\n".join(src) + "\n")
    (tmp_path / "p.tgt").write_text("\n".join(s.upper() for s in src) + "\n")
    (tmp_path / "labels.jsonl").write_text("".join(f'{{"text": "{s}", "label": "{s.split()[1]}"}}\n' for s in src))
    return {"corpus": corpus, "src": tmp_path / "p.src", "tgt": tmp_path / "p.tgt", "labels": tmp_path / "labels.jsonl"}


def test_every_preset_is_covered():
    assert sorted(EXTRA) == preset_names()


@pytest.mark.parametrize("preset", sorted(EXTRA))
def test_a_preset_trains_reports_and_its_suggested_commands_exit_0(preset, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BLOCKFORMER_CACHE", str(tmp_path / "cache"))
    files = _files(tmp_path)
    sets = [item.format(**files) for item in [*SMALL, *EXTRA[preset]]]
    argv = ["train", "--preset", preset, *[a for s in sets for a in ("--set", s)], "--out", str(tmp_path / "run")]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "(no samples" not in out and "checkpoint: " in out
    if preset in ("char-lm-tiny", "stdlib-lm"):
        assert out.count("-" * 60) >= 2  # the samples were printed
    # the "next:" commands of the report, shortened
    for line in out.split("\nnext:\n", 1)[1].splitlines():
        cmd = shlex.split(line.split("   (")[0].strip())
        if not cmd or cmd[:2] == ["blockformer", "train"]:
            continue
        args = cmd[1:]
        if args[0] == "generate":
            args = [a if a != "300" else "80" for a in args]  # --max-new-tokens 80: past the 64-position table
        if args[0] == "translate":
            monkeypatch.setattr("sys.stdin", open(files["src"]))
            args += ["--beam", "2", "--quiet"]
        if args[0] == "eval":
            args += ["--batches", "2"]
        assert main(args) == 0, (args, capsys.readouterr().err)
        capsys.readouterr()
