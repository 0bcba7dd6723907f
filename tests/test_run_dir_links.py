"""The trainer never writes through a symbolic link in its run directory: a link named like
one of its files or checkpoints is refused (one line naming it, exit 2) and whatever it
points at, outside the run, is left byte for byte as it was."""

import hashlib
import os
import shutil

import pytest

from blockformer.cli import main
from blockformer.errors import UsageError
from blockformer.train import load as ld
from blockformer.train import train
from blockformer.train.metrics import MetricsLog
from blockformer.paths import replace_file
from blockformer.train.run_dir import LOCK

from test_train_loop import QUIET, tiny_task


def _digest(path) -> str:
    """The bytes of a file, or of every file under a directory, as one hash."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("links") / "run"
    train(tiny_task("train.steps=2", "train.eval_every=1", "train.keep_last=5"), run, **QUIET)
    names = {p.name for p in run.iterdir()}
    assert {"config.toml", "metrics.jsonl", "loss.png", "best", "step-000002"} <= names
    return run


def _copy_with_link(finished_run, tmp_path, name):
    """A copy of the run whose ``name`` is a link to an outside copy of what was there."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    target = run / name
    if target.is_symlink():  # best: link to a copy of the checkpoint it names
        shutil.copytree(target.resolve(), outside)
        target.unlink()
    else:
        shutil.move(target, outside)
    os.symlink(outside, target)
    return run, outside


NAMES = ["config.toml", "metrics.jsonl", "loss.png", "step-000002", "step-000001", "best"]


@pytest.mark.parametrize("name", NAMES)
def test_resuming_a_run_with_a_link_among_its_names_is_refused_and_the_target_kept(
        finished_run, tmp_path, capsys, name):
    run, outside = _copy_with_link(finished_run, tmp_path, name)
    before = _digest(outside)
    argv = ["train", "--resume", str(run), "--out", str(run), "--set", "train.steps=4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / name}: is a symbolic link" in err, err
    assert _digest(outside) == before
    assert (run / name).is_symlink()  # refused before anything was written
    assert not (run / LOCK).exists()


def test_best_as_the_trainer_writes_it_is_accepted(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    assert os.readlink(run / "best") in ("step-000001", "step-000002")
    cfg = ld.read_config(run / "step-000002")
    cfg.train.steps = 3
    assert train(cfg, run, resume=run, **QUIET).step == 3


def test_a_fresh_run_with_overwrite_refuses_links_too(finished_run, tmp_path):
    run, outside = _copy_with_link(finished_run, tmp_path, "metrics.jsonl")
    before = _digest(outside)
    with pytest.raises(UsageError, match="metrics.jsonl: is a symbolic link"):
        train(tiny_task("train.steps=1"), run, overwrite=True, **QUIET)
    assert _digest(outside) == before


def test_a_lock_that_is_a_link_is_replaced_not_written_through(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("not a lock\n")
    os.symlink(outside, run / LOCK)
    cfg = ld.read_config(run / "step-000002")
    cfg.train.steps = 3
    assert train(cfg, run, resume=run, **QUIET).step == 3
    assert outside.read_text() == "not a lock\n" and not (run / LOCK).exists()


def test_whole_files_replace_a_link_and_appends_refuse_one(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    os.symlink(outside, tmp_path / "file")
    replace_file(tmp_path / "file", b"new\n")
    assert not (tmp_path / "file").is_symlink() and (tmp_path / "file").read_text() == "new\n"
    run = tmp_path / "run"
    log = MetricsLog(run)
    (run / "metrics.jsonl").unlink()
    os.symlink(outside, run / "metrics.jsonl")
    with pytest.raises(OSError):
        log.write({"step": 1})
    assert outside.read_text() == "keep\n"
