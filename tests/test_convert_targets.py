"""``convert --out`` never destroys what the user did not name.

Without ``--overwrite`` a directory holding anything (a run's checkpoints, a checkpoint,
the user's own files) and a file are refused, one line and exit 2, and left as they were;
with it they are replaced whole. The source itself, a directory holding it and one inside
it are refused even with ``--overwrite``. A missing or empty directory is fine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockformer import TransformerConfig, build_model
from blockformer.cli import main
from blockformer.errors import UsageError
from blockformer.interop import from_hf, to_hf
from blockformer.run_config import RunConfig
from blockformer.tokenizers import CharTokenizer
from blockformer.train.checkpoint import save_checkpoint, step_checkpoints
from blockformer.train.load import load_checkpoint

CFG = TransformerConfig(arch="decoder", vocab_size=12, d_model=16, n_layers=1, n_heads=2, max_seq_len=16,
                        norm="rms", ffn="swiglu", position="rope", bias=False, scale_embeddings=False)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A blockformer checkpoint of a Llama-family model (exportable)."""
    return save_checkpoint(tmp_path / "ck", build_model(CFG, seed=0), CharTokenizer("abcdefgh"), RunConfig(model=CFG))


@pytest.fixture
def hf(tmp_path, ckpt) -> Path:
    """A Hugging Face directory with a tokenizer.json (so --from-hf can write a checkpoint)."""
    from tokenizers import Tokenizer, models

    out = to_hf(ckpt, tmp_path / "hf")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 12)}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(out / "tokenizer.json"))
    return out


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys, *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def _run_dir(tmp_path: Path, ckpt: Path) -> Path:
    run = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(run / f"step-00000{step}", load_checkpoint(ckpt).model, CharTokenizer("abcdefgh"),
                        RunConfig(model=CFG), {"step": step})
    return run


def _user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    (d / "notes").mkdir(parents=True)
    (d / "notes" / "a.txt").write_text("keep me")
    (d / "b.bin").write_bytes(b"\x00\x01")
    return d


TARGETS = {"run directory": _run_dir, "checkpoint": lambda tmp, ck: ck.parent / "other-ck",
           "user's files": lambda tmp, ck: _user_dir(tmp)}


def _target(name: str, tmp_path: Path, ckpt: Path) -> Path:
    out = TARGETS[name](tmp_path, ckpt)
    if name == "checkpoint":
        save_checkpoint(out, load_checkpoint(ckpt).model, CharTokenizer("abcdefgh"), RunConfig(model=CFG))
    return out


@pytest.mark.parametrize("direction", ["--to-hf", "--from-hf"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_directory_holding_something_is_refused_and_kept(tmp_path, ckpt, hf, capsys, direction, target):
    out = _target(target, tmp_path, ckpt)
    before = _snapshot(out)
    source = ckpt if direction == "--to-hf" else hf
    _refused(["convert", direction, str(source), "--out", str(out)], capsys, "--out", str(out), "--overwrite")
    assert _snapshot(out) == before
    if target == "run directory":
        assert len(step_checkpoints(out)) == 2


@pytest.mark.parametrize("direction", ["--to-hf", "--from-hf"])
def test_overwrite_replaces_the_directory_whole(tmp_path, ckpt, hf, capsys, direction):
    out = _target("run directory", tmp_path, ckpt)
    source = ckpt if direction == "--to-hf" else hf
    assert main(["convert", direction, str(source), "--out", str(out), "--overwrite"]) == 0, capsys.readouterr().err
    assert not step_checkpoints(out) and not list(out.glob("step-*"))
    if direction == "--to-hf":
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                         "model.safetensors"]  # + the model card and generate()'s defaults
        assert from_hf(out).config.d_model == CFG.d_model
    else:
        assert load_checkpoint(out).config.model.d_model == CFG.d_model
    assert not list(out.parent.glob(".*tmp-*"))  # no staging left beside it


@pytest.mark.parametrize("direction", ["--to-hf", "--from-hf"])
@pytest.mark.parametrize("where", ["source", "inside", "around"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_the_source_and_directories_around_or_inside_it_are_refused(tmp_path, ckpt, hf, capsys, direction, where,
                                                                    overwrite):
    source = ckpt if direction == "--to-hf" else hf
    out = {"source": source, "inside": source / "sub", "around": source.parent}[where]
    before = _snapshot(source)
    word = {"source": "is the source", "inside": "is inside the source", "around": "holds the source"}[where]
    _refused(["convert", direction, str(source), "--out", str(out), *(["--overwrite"] * overwrite)], capsys,
             "--out", word)
    assert _snapshot(source) == before
    load_checkpoint(ckpt)  # still loadable
    from_hf(hf)


def test_the_source_through_a_link_is_refused(tmp_path, ckpt, capsys):
    """``best`` is a symlink to a step: exporting a step onto it (or back) is the same directory."""
    run = _run_dir(tmp_path, ckpt)
    (run / "best").symlink_to("step-000002")
    _refused(["convert", "--to-hf", str(run / "best"), "--out", str(run / "step-000002"), "--overwrite"], capsys,
             "is the source")
    assert len(step_checkpoints(run)) == 2


def test_a_file_is_refused_even_with_overwrite(tmp_path, ckpt, capsys):
    out = tmp_path / "file.txt"
    out.write_text("mine")
    for extra in ([], ["--overwrite"]):
        _refused(["convert", "--to-hf", str(ckpt), "--out", str(out), *extra], capsys, "--out", "is a file")
    assert out.read_text() == "mine"


@pytest.mark.parametrize("direction", ["--to-hf", "--from-hf"])
def test_a_missing_or_empty_directory_is_fine(tmp_path, ckpt, hf, capsys, direction):
    source = ckpt if direction == "--to-hf" else hf
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new" / "deeper", empty):
        assert main(["convert", direction, str(source), "--out", str(out)]) == 0, capsys.readouterr().err
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_to_hf_in_python_refuses_alike(tmp_path, ckpt):
    mine = _user_dir(tmp_path)
    with pytest.raises(UsageError, match="overwrite=True"):
        to_hf(ckpt, mine)
    assert (mine / "notes" / "a.txt").read_text() == "keep me"
    with pytest.raises(UsageError, match="is the source"):
        to_hf(ckpt, ckpt, overwrite=True)
    to_hf(ckpt, mine, overwrite=True)
    assert json.loads((mine / "config.json").read_text())["model_type"] == "llama"
    assert not (mine / "notes").exists()


def test_the_current_directory_and_its_parents_are_refused(tmp_path, ckpt, capsys, monkeypatch):
    work = tmp_path / "a" / "work"  # its parent does not hold the source
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for out in (".", "..", str(work)):
        _refused(["convert", "--to-hf", str(ckpt), "--out", out, "--overwrite"], capsys, "current directory")
    assert work.is_dir() and ckpt.is_dir()
