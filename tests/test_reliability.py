"""Never lose a run: run-directory safety, crash-safe checkpoints, one-line filesystem
errors, non-finite losses, exit codes, and checkpoints that are data, not instructions."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from blockformer import build_model
from blockformer.cli import main
from blockformer.errors import UsageError
from blockformer.run_config import load_run_config, read_toml
from blockformer.tokenizers import CharTokenizer
from blockformer.train import checkpoint as ck
from blockformer.train import load as ld
from blockformer.train import train
from blockformer.train.average import last_checkpoints
from blockformer.train.loop import NonFiniteLoss
from blockformer.train.objective import LanguageModelling
from blockformer.train.run_dir import LOCK, RunLock

from test_train_loop import QUIET, tiny_lm, tiny_task


def _one_line_error(capsys, argv, code=2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ 1. a new run never destroys an old one
def test_a_fresh_run_into_a_used_directory_is_refused_and_overwrite_replaces_it(tmp_path):
    cfg = tiny_task("train.steps=2", "train.eval_every=0")
    first = train(cfg, tmp_path / "run", **QUIET)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(UsageError) as e:
        train(cfg, tmp_path / "run", **QUIET)
    for what in (str(tmp_path / "run"), "--resume", "--out", "--overwrite"):
        assert what in str(e.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # nothing touched
    assert ld.load_checkpoint(first.checkpoint).config.train.steps == 2
    again = train(tiny_task("train.steps=3", "train.eval_every=0"), tmp_path / "run", overwrite=True, **QUIET)
    assert [p.name for p in ck.step_checkpoints(tmp_path / "run")] == ["step-000003"]
    assert again.step == 3 and not (tmp_path / "run" / LOCK).exists()


def test_the_cli_refuses_rerunning_a_preset_into_its_default_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["train", "--preset", "copy", "--set", "train.steps=1", "--set", "model.d_model=16",
            "--set", "model.n_layers=1", "--set", "model.n_heads=2", "--set", "model.d_ff=32",
            "--set", "train.progress=false", "--set", "data.heldout=10", "--set", "train.eval_samples=5"]
    assert main(args) == 0
    capsys.readouterr()
    err = _one_line_error(capsys, args)
    assert "runs/copy: already holds 1 checkpoint of an earlier run" in err and "--overwrite" in err
    assert main([*args, "--overwrite"]) == 0


# ------------------------------------------------------------------ 2. one writer per run directory
def test_a_second_writer_is_refused_while_the_first_lives(tmp_path):
    run = tmp_path / "run"
    with RunLock(run):
        owner = json.loads((run / LOCK).read_text())
        assert owner["pid"] == os.getpid()
        # Another live process on this host holds it: pretend the lock is the parent's.
        (run / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": owner["host"]}))
        with pytest.raises(UsageError, match=rf"another training is writing there \(pid {os.getppid()}"):
            train(tiny_task("train.steps=1"), run, **QUIET)
        (run / LOCK).write_text(json.dumps(owner))
    assert not (run / LOCK).exists()  # released on exit


def test_only_rank_0_of_a_distributed_run_takes_the_lock(tmp_path, monkeypatch):
    import socket

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))  # rank 0's
    monkeypatch.setenv("RANK", "1")
    assert train(tiny_task("train.steps=1", "train.eval_every=0"), run, **QUIET).step == 1
    assert json.loads((run / LOCK).read_text())["pid"] == os.getppid()  # left to its owner
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="another training is writing there"):
        train(tiny_task("train.steps=1", "train.eval_every=0"), run, **QUIET)


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    result = train(tiny_task("train.steps=1", "train.eval_every=0"), run, **QUIET)
    assert result.step == 1 and not (run / LOCK).exists()


def test_the_lock_is_released_when_training_fails(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr("blockformer.train.loop.build_run", boom)
    with pytest.raises(RuntimeError, match="boom"):
        train(tiny_task("train.steps=1"), tmp_path / "run", **QUIET)
    assert not (tmp_path / "run" / LOCK).exists()


# ------------------------------------------------------------------ 3. atomic saves with no window
def _small():
    tok = CharTokenizer("abcdefgh")
    cfg = load_run_config(overrides=["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32",
                                     f"model.vocab_size={tok.vocab_size}", "model.max_seq_len=8"])
    return cfg, build_model(cfg.model, seed=0), tok


class Crash(BaseException):
    """Stands in for kill -9 between two operations (BaseException: nothing catches it)."""


# The operations of the save/prune protocol, patched to crash at the k-th one.
OPS = [(os, "replace"), (os, "mkdir"), (os, "symlink"), (ck, "_exchange"), (ck, "_fsync"), (shutil, "rmtree")]


def _arm(monkeypatch, k: int) -> dict:
    state = {"n": 0, "fired": False}
    for owner, name in OPS:
        original = getattr(owner, name)

        def wrapper(*a, __original=original, __name=name, **kw):
            state["n"] += 1
            if state["n"] == k and not state["fired"]:
                state["fired"] = True
                if __name == "rmtree" and os.path.isdir(a[0]):  # a half-finished delete
                    files = [os.path.join(a[0], f) for f in sorted(os.listdir(a[0]))]
                    if files and os.path.isfile(files[0]):
                        os.remove(files[0])
                raise Crash(f"crash before {__name}")
            return __original(*a, **kw)

        monkeypatch.setattr(owner, name, wrapper)
    return state


@pytest.mark.parametrize("exchange", [True, False])
def test_a_crash_at_any_step_of_save_best_and_prune_leaves_loadable_checkpoints(tmp_path, monkeypatch, exchange):
    """Re-save step 20 (the best), mark it best and prune to 1, crashing before each
    operation in turn: every time, after the next start's recovery (and, with an atomic
    exchange, even before it) step 20 and ``best`` load, and nothing half-written is listed."""
    cfg, model, tok = _small()
    if not exchange:
        monkeypatch.setattr(ck, "_exchange", lambda a, b: False)
    k = 0
    while True:
        k += 1
        run = tmp_path / f"run{k}"
        for step in (10, 20):
            ck.save_checkpoint(run / ck.step_dir_name(step), model, tok, cfg, {"step": step})
        ck.mark_best(run, run / "step-000020")
        with monkeypatch.context() as m:
            state = _arm(m, k)
            try:
                ck.save_checkpoint(run / "step-000020", model, tok, cfg, {"step": 20, "resaved": True})
                ck.mark_best(run, run / "step-000020")
                ck.prune(run, keep_last=1)
            except Crash:
                pass
        if exchange:
            assert ck.best_checkpoint(run) is not None, f"best dangles after a crash at op {k}"
        ck.recover(run)  # what the next start of this run does, holding the lock
        listed = ck.step_checkpoints(run)
        assert listed[-1].name == "step-000020", k
        for p in [*listed, ck.best_checkpoint(run)]:
            assert p is not None, f"best dangles after a crash at op {k}"
            ld.load_checkpoint(p)
            assert ld.load_trainer_state(p)["step"] == int(p.resolve().name[-6:])
        assert not [p for p in run.iterdir() if p.name.startswith(".")], k  # temporaries cleaned
        if not state["fired"]:
            break
    assert k > 8  # the protocol has that many operations, each crashed once


def test_listing_ignores_temporary_trash_and_incomplete_directories(tmp_path):
    cfg, model, tok = _small()
    run = tmp_path / "run"
    for step in (1, 2, 3):
        ck.save_checkpoint(run / ck.step_dir_name(step), model, tok, cfg, {"step": step})
    shutil.copytree(run / "step-000003", run / f".step-000004{ck.TMP_TAG}999")
    shutil.copytree(run / "step-000003", run / f".step-000000{ck.TRASH_TAG}999")
    (run / "step-000005").mkdir()  # incomplete: no weights
    (run / "step-000005" / "config.json").write_text("{}")
    assert [p.name for p in ck.step_checkpoints(run)] == ["step-000001", "step-000002", "step-000003"]
    assert [p.name for p in last_checkpoints(run, 2)] == ["step-000002", "step-000003"]
    assert ck.resolve_checkpoint(run, prefer="latest").name == "step-000003"


def test_stale_temporaries_are_removed_at_the_next_start_of_the_run(tmp_path):
    cfg = tiny_task("train.steps=4", "train.eval_every=0")
    train(cfg, tmp_path / "run", stop_at=2, **QUIET)
    stale = tmp_path / "run" / f".step-000003{ck.TMP_TAG}4242"
    shutil.copytree(tmp_path / "run" / "step-000002", stale)
    result = train(cfg, tmp_path / "run", resume=tmp_path / "run", **QUIET)
    assert result.step == 4 and not stale.exists()


# ------------------------------------------------------------------ 4. every filesystem error is one line
def test_output_paths_that_are_files_or_unwritable_give_one_line(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    base = ["train", "--preset", "copy", "--set", "train.steps=1", "--set", "train.progress=false"]
    assert "is a file" in _one_line_error(capsys, [*base, "--out", str(a_file)])
    assert "is a file" in _one_line_error(capsys, [*base, "--out", str(a_file / "run")])
    if os.path.isdir("/proc/self"):  # unwritable even for root
        err = _one_line_error(capsys, [*base, "--out", "/proc/self/blockformer-run"])
        assert "/proc/self/blockformer-run" in err
    if os.geteuid() != 0:  # root writes into read-only directories
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            assert "permission denied" in _one_line_error(capsys, [*base, "--out", str(ro / "run")])
        finally:
            ro.chmod(0o755)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    base = ["train", "--preset", "copy", "--set", "train.steps=4", "--set", "train.eval_every=2",
            "--set", "train.progress=false", "--set", "model.d_model=16", "--set", "model.n_heads=2",
            "--set", "model.n_layers=1", "--set", "model.d_ff=32", "--out", str(out)]
    original, calls = torch.save, []

    def full(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return original(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    err = _one_line_error(capsys, base)
    assert "No space left on device" in err and "trainer_state.pt" in err
    assert [p.name for p in ck.step_checkpoints(out)] == ["step-000002"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temporary, no lock
    ld.load_checkpoint(out / "step-000002")


def test_a_full_disk_writing_the_loss_plot_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = ["train", "--preset", "copy", "--set", "train.steps=2", "--set", "train.eval_every=1",
            "--set", "train.progress=false", "--set", "model.d_model=16", "--set", "model.n_heads=2",
            "--set", "model.n_layers=1", "--set", "model.d_ff=32", "--set", "data.heldout=10",
            "--set", "train.eval_samples=5", "--out", str(out)]
    original = os.write

    def full(fd, data):  # the device fills up under the plot's file, and only there
        if "loss.png" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(fd, data)

    monkeypatch.setattr(os, "write", full)
    err = _one_line_error(capsys, argv)
    assert f"{out / 'loss.png'}: No space left on device" in err
    assert not (out / "loss.png").exists() and not [p for p in out.iterdir() if "loss.png" in p.name]
    assert [p.name for p in ck.step_checkpoints(out)] == ["step-000001", "step-000002"]  # the run is saved


def _torn(run, text: bytes) -> None:
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(text)


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    run = tmp_path / "run"
    train(tiny_task("train.steps=2", "train.eval_every=1"), run, **QUIET)
    whole = (run / "metrics.jsonl").read_bytes()
    _torn(run, '{"split": "train", "step": 3, "loss": 1.2, "note": "\u00e9'.encode()[:-1])  # cut mid-character
    cfg, torn_line = tiny_task("train.steps=3", "train.eval_every=1"), whole.count(b"\n") + 1
    with pytest.warns(UserWarning, match=re.escape(f"{run / 'metrics.jsonl'}: line {torn_line} is cut short")):
        assert train(cfg, run, resume=run, **QUIET).step == 3
    lines = (run / "metrics.jsonl").read_bytes().splitlines()
    assert b"\n".join(lines[: whole.count(b"\n")]) + b"\n" == whole  # the records before it are kept
    assert [json.loads(x)["step"] for x in lines[-2:]] == [3, 3]  # and the resumed step's appended


def test_a_corrupt_metrics_line_before_the_last_names_the_file_and_line(tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_task("train.steps=2", "train.eval_every=1"), run, **QUIET)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:-5]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    err = _one_line_error(capsys, ["train", "--resume", str(run), "--set", "train.steps=3"])
    assert f"{run / 'metrics.jsonl'}: line 2 is not a metrics record" in err


def test_a_cache_directory_that_is_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "cache"
    blocker.write_text("x")
    (tmp_path / "c.txt").write_text("hello world\n" * 50)
    err = _one_line_error(capsys, ["train", "--set", f"data.text={tmp_path / 'c.txt'}", "--set",
                                   f"data.cache_dir={blocker}", "--set", "data.tokenizer=char",
                                   "--out", str(tmp_path / "run")])
    assert str(blocker) in err and "token cache" in err


# ------------------------------------------------------------------ 5. inputs checked where they enter
@pytest.mark.parametrize("item, message", [
    ("train.lr=inf", "train.lr=inf: expected a finite number"),
    ("train.lr=nan", "train.lr=nan: expected a finite number"),
    ("train.lerning_rate=1e-3", "train.lerning_rate: unknown key (did you mean 'lr'?)"),
    ("train.steps=100000000000000000000", "expected an integer below 2**53"),
    ("train.nonfinite=ignore", "expected one of 'stop', 'skip'"),
])
def test_config_values_are_checked_and_named(item, message):
    with pytest.raises((UsageError, ValueError)) as e:
        load_run_config(overrides=[item])
    assert message in str(e.value)


def test_a_non_utf8_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b"[train]\nname = \"\xff\xfe\"\n")
    with pytest.raises(UsageError, match=rf"{path}: not UTF-8 text"):
        read_toml(path)


def test_a_truncated_token_cache_is_detected_and_rebuilt(tmp_path):
    from blockformer.data.token_file import TokenFile, build_token_file

    tok = CharTokenizer("ab ")
    path = build_token_file(iter(["ab ab ba " * 100]), tok, tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])  # a copy cut short
    with pytest.raises(UsageError, match="truncated or damaged"):
        TokenFile(path)
    assert build_token_file(iter(["ab ab ba " * 100]), tok, tmp_path) == path
    assert path.read_bytes() == whole and len(TokenFile(path)) == (len(whole) - 64) // 2


def _nan_at(monkeypatch, step: int, shards: int = 1) -> None:
    """A NaN loss at training step ``step``: in one of its ``shards`` (train.batch_threads), which
    makes the step's summed loss NaN."""
    original, calls = LanguageModelling.loss, []

    def loss(self, model, batch, smoothing=0.0):
        value = original(self, model, batch, smoothing)
        if not model.training:  # evaluation
            return value
        calls.append(1)
        return value * float("nan") if len(calls) == (step - 1) * shards + 1 else value

    monkeypatch.setattr(LanguageModelling, "loss", loss)


def test_a_nan_loss_stops_the_run_keeping_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    _nan_at(monkeypatch, 5)
    cfg = tiny_lm(tmp_path, "train.steps=8", "train.eval_every=2", "train.batch_threads=1")
    with pytest.raises(NonFiniteLoss, match="NaN or infinite at step 5; .*Last checkpoint: .*step-000004"):
        train(cfg, tmp_path / "run", **QUIET)
    last = ck.step_checkpoints(tmp_path / "run")[-1]
    assert last.name == "step-000004"
    assert all(torch.isfinite(p).all() for p in ld.load_checkpoint(last).model.parameters())
    # on the command line: exit code 3, one line
    _nan_at(monkeypatch, 3)
    argv = ["train", "--out", str(tmp_path / "cli"), *[a for item in [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.progress=false",
        f"data.text={tmp_path / 'corpus.txt'}", "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8", "train.steps=4"] for a in ("--set", item)]]
    assert "loss became NaN" in _one_line_error(capsys, argv, code=3)


@pytest.mark.parametrize("threads", [1, 2])
def test_nonfinite_skip_skips_the_update_and_carries_on(tmp_path, monkeypatch, threads):
    """Also with the rows split over threads, where one shard's NaN makes the step's."""
    _nan_at(monkeypatch, 3, shards=threads)
    cfg = tiny_lm(tmp_path, "train.steps=6", "train.eval_every=0", "train.nonfinite=skip", "train.log_every=3",
                  f"train.batch_threads={threads}")
    result = train(cfg, tmp_path / "run", **QUIET)
    assert result.step == 6 and result.skipped == 1
    assert [x != x for x in result.losses] == [False, False, True, False, False, False]  # one loss per step
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] == r["loss"] for r in records if r["split"] == "train"] == [True, True]  # finite means
    assert all(torch.isfinite(p).all() for p in ld.load_checkpoint(result.checkpoint).model.parameters())


# ------------------------------------------------------------------ 6. a checkpoint is data, not instructions
def test_eval_does_not_read_or_write_the_paths_a_checkpoint_names(tmp_path, capsys, monkeypatch):
    cfg, model, tok = _small()
    secret = tmp_path / "secret.txt"
    secret.write_text("abc" * 100)
    cache = tmp_path / "planted-cache"
    cfg.data.text, cfg.data.cache_dir = str(secret), str(cache)
    path = ck.save_checkpoint(tmp_path / "ck", model, tok, cfg)
    monkeypatch.setenv("BLOCKFORMER_CACHE", str(tmp_path / "my-cache"))
    err = _one_line_error(capsys, ["eval", "--checkpoint", str(path)])
    assert "--data: missing" in err and str(secret) in err
    assert not cache.exists()
    other = tmp_path / "mine.txt"
    other.write_text("abcdefgh " * 200)
    assert main(["eval", "--checkpoint", str(path), "--data", str(other), "--json", "--batches", "1"]) == 0
    assert not cache.exists() and any((tmp_path / "my-cache").iterdir())  # the user's cache, not the planted one


@pytest.mark.parametrize("entry", ['"bpe"', "[1, 2]", '{"fingerprint": 7}'])
def test_a_malformed_tokenizer_entry_is_one_line(tmp_path, capsys, entry):
    cfg, model, tok = _small()
    path = ck.save_checkpoint(tmp_path / "ck", model, tok, cfg)
    data = json.loads((path / "config.json").read_text())
    data["tokenizer"] = json.loads(entry)
    (path / "config.json").write_text(json.dumps(data))
    err = _one_line_error(capsys, ["generate", "--checkpoint", str(path), "--max-new-tokens", "2"])
    assert "'tokenizer'" in err and "expected an object" in err


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_malicious_pickle_in_the_trainer_state_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, model, tok = _small()
    path = ck.save_checkpoint(tmp_path / "ck", model, tok, cfg, {"step": 1})
    torch.save({"step": 1, "payload": _Evil()}, path / ck.STATE)
    with pytest.raises(UsageError) as e:
        ld.load_trainer_state(path)
    assert "refused" in str(e.value) and "damaged" not in str(e.value)
    assert not (tmp_path / "PWNED").exists()
    (path / ck.STATE).write_bytes(b"\x80\x04garbage")  # a damaged file is reported as damaged
    with pytest.raises(UsageError, match="damaged"):
        ld.load_trainer_state(path)


# ------------------------------------------------------------------ 9. exit codes say what happened
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_run_stopped_by_a_signal_saves_and_exits_with_128_plus_the_signal(tmp_path, monkeypatch, capsys,
                                                                           signum, code):
    original, calls = LanguageModelling.next_batch, []

    def next_batch(self):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)
        return original(self)

    monkeypatch.setattr(LanguageModelling, "next_batch", next_batch)
    tiny_lm(tmp_path)  # writes the corpus
    argv = ["train", "--out", str(tmp_path / "run"), *[a for item in [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.progress=false",
        f"data.text={tmp_path / 'corpus.txt'}", "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8", "train.steps=6"] for a in ("--set", item)]]
    assert main(argv) == code
    assert "continue with:  blockformer train --resume" in capsys.readouterr().out
    assert ld.load_trainer_state(ck.step_checkpoints(tmp_path / "run")[-1])["step"] == 2
