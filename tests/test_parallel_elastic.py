"""Elastic restarts resume, hangs end: train.resume="auto" (--resume-if-exists) continues a run
from its own latest checkpoint, so `torchrun --max-restarts=1` recovers from a killed rank with
an uninterrupted run's losses; a stopped rank ends the job after parallel.timeout with one line
naming it.

Run as a script (``python tests/test_parallel_elastic.py train ARGS``, what torchrun starts
here) this file is `blockformer train` with one test-only fault: ``ELASTIC_FAULT=kill:RANK:N``
or ``stop:RANK:N`` SIGKILLs or SIGSTOPs rank RANK as it starts its N-th step, in torchrun's
first attempt only (``TORCHELASTIC_RESTART_COUNT=0``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.d_ff=64", "model.bias=false",
        "data.task_max_len=6", "data.heldout=20", "train.batch_size=8", "train.eval_batches=1",
        "train.eval_samples=4", "train.warmup=2", "train.precision=fp32", "train.progress=false",
        "train.log_every=1"]
QUIET = {"log": lambda *a: None}


def copy_config(*overrides: str):
    from blockformer.run_config import load_run_config  # noqa: PLC0415

    return load_run_config(preset="copy", overrides=[*TINY, *overrides])


def train_losses(run_dir: Path) -> dict[int, float]:
    from blockformer.train.metrics import read_metrics  # noqa: PLC0415

    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r.get("split") == "train"}


# ---------------------------------------------------------------------- one process
def test_resume_auto_starts_fresh_then_continues_from_the_latest_checkpoint(tmp_path):
    from blockformer.train import train  # noqa: PLC0415

    cfg = copy_config("train.steps=12", "train.eval_every=4", "train.resume=auto")
    straight = train(cfg, tmp_path / "a", **QUIET)
    first = train(cfg, tmp_path / "b", stop_at=6, **QUIET)  # saved at 4 (an evaluation) and 6 (the stop)
    logged: list[str] = []
    second = train(cfg, tmp_path / "b", log=logged.append)
    assert f"{tmp_path / 'b'}: train.resume=auto: continuing from step-000006" in logged
    assert (first.step, second.step) == (6, 12)
    assert first.losses + second.losses == straight.losses  # bit for bit: data position and RNG restored
    assert train_losses(tmp_path / "b") == train_losses(tmp_path / "a")
    third = train(cfg, tmp_path / "b", **QUIET)  # finished: it resumes at the end and trains nothing
    assert third.step == 12 and third.losses == []


def test_resume_auto_refuses_another_config_naming_the_first_field_that_differs(tmp_path, capsys):
    from blockformer.cli import main  # noqa: PLC0415

    out = str(tmp_path / "run")
    args = ["train", "--preset", "copy", *[a for o in TINY for a in ("--set", o)], "--set", "train.steps=2",
            "--set", "train.eval_every=0", "--out", out, "--resume-if-exists"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--set", "parallel.timeout=9"]) == 0  # [parallel] is the launch, not the run: resumed
    capsys.readouterr()
    assert main([*args, "--set", "train.lr=0.01"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "train.resume='auto' continues this run, but it was written with train.lr=0.001 and this config has " \
           "0.01" in err and f"--resume {out} --set train.lr=..." in err
    assert main([*args, "--resume", out]) == 2
    assert "--resume-if-exists: resumes the run directory" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 2
    assert "train.resume='auto' (--resume-if-exists): continues the run" in capsys.readouterr().err


def test_resume_auto_after_an_attempt_that_left_no_checkpoint_and_a_dead_lock_starts_fresh(tmp_path):
    from blockformer.train import train  # noqa: PLC0415
    from blockformer.train.run_dir import LOCK  # noqa: PLC0415

    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / LOCK).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}) + "\n")
    (run / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 9.0}\n')
    (run / "config.toml").write_text("")
    cfg = copy_config("train.steps=2", "train.eval_every=0", "train.resume=auto")
    result = train(cfg, run, **QUIET)
    assert result.step == 2 and sorted(train_losses(run)) == [1, 2] and train_losses(run)[1] != 9.0
    assert not (run / LOCK).exists()
    (run / "notes.txt").write_text("mine")  # not a trainer's file: a directory in use, refused as ever
    shutil.rmtree(run / "step-000002")
    from blockformer.errors import UsageError  # noqa: PLC0415

    with pytest.raises(UsageError, match="already holds"):
        train(cfg, run, **QUIET)


def test_a_lock_of_an_earlier_attempt_of_the_same_torchrun_job_is_stale_on_any_node(tmp_path, monkeypatch):
    from blockformer.errors import UsageError  # noqa: PLC0415
    from blockformer.train.run_dir import LOCK, RunLock  # noqa: PLC0415

    run = tmp_path / "run"
    run.mkdir()
    # rank 0 of the killed attempt ran on another node, whose processes this one cannot see
    (run / LOCK).write_text(json.dumps({"pid": 4242, "host": "node-7", "job": "job-1"}) + "\n")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(UsageError, match="another training is writing there \\(pid 4242 on node-7\\)"):
        RunLock(run).acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # another job: the user decides, as before
    with pytest.raises(UsageError, match="another training is writing there"):
        RunLock(run).acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")  # a restart of that job: torchrun stopped its workers
    lock = RunLock(run).acquire()
    assert json.loads((run / LOCK).read_text()) == {"pid": os.getpid(), "host": os.uname().nodename, "job": "job-1"}
    lock.release()
    assert not (run / LOCK).exists()


def test_resume_and_timeout_values_are_checked_and_named():
    from blockformer.errors import UsageError  # noqa: PLC0415
    from blockformer.run_config import RunConfig, load_run_config  # noqa: PLC0415

    cases = [(lambda: load_run_config(overrides=["train.resume=always"]),
              "--set train.resume=always: expected one of 'none', 'auto'"),
             (lambda: RunConfig.from_dict({"train": {"resume": "always"}}),  # a TOML file's value
              "train.resume='always': expected one of 'none', 'auto'"),
             (lambda: load_run_config(overrides=["parallel.timeout=0"]), "parallel.timeout=0.0: expected seconds > 0"),
             (lambda: RunConfig.from_dict({"parallel": {"timeout": -1}}), "parallel.timeout=-1: expected seconds > 0"),
             (lambda: RunConfig.from_dict({"parallel": {"timeout": "5"}}), "parallel.timeout='5': expected float")]
    for make, message in cases:
        with pytest.raises(ValueError) as caught:  # UsageError is a ValueError, as check_types raises
            make()
        assert str(caught.value).startswith(message) and "\n" not in str(caught.value), caught.value
    assert load_run_config().parallel.timeout == 300.0 and load_run_config().train.resume == "none"
    assert issubclass(UsageError, ValueError)


def test_every_sub_group_of_the_mesh_gets_the_timeout_and_other_errors_are_not_hangs():
    from datetime import timedelta  # noqa: PLC0415

    from blockformer.parallel.mesh import Degrees, _group_timeouts, stopped_ranks  # noqa: PLC0415

    wait = timedelta(seconds=7)
    # dims of one rank need no group; a dim as wide as the world is the default group, made with the timeout
    assert _group_timeouts(Degrees(1, 1, 2, 1), "gloo", wait) == {}
    groups = _group_timeouts(Degrees(2, 1, 2, 2), "gloo", wait)  # new_group would give these 30 minutes
    assert sorted(groups) == ["dp_shard", "pp", "tp"]
    assert all(backend == "gloo" and options._timeout == wait for backend, options in groups.values())
    assert len({id(options) for _, options in groups.values()}) == 3  # one object each: torch writes into them
    assert stopped_ranks(RuntimeError("shape mismatch"), 5) is None
    assert stopped_ranks(ValueError("timed out"), 5) is None  # not a collective's error


def test_a_rank_that_never_joins_ends_the_start_after_the_timeout_in_one_line(monkeypatch, capsys, tmp_path):
    from blockformer.cli import main  # noqa: PLC0415

    from parallel_helpers import free_port  # noqa: PLC0415

    for name, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)  # rank 0 of two, and rank 1 never starts
    args = ["train", "--preset", "copy", "--set", "train.steps=1", "--set", "parallel.timeout=1"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 4
    err = capsys.readouterr().err.strip()
    assert err.startswith("blockformer train: error: parallel: the 2 ranks did not all join within "
                          "parallel.timeout=1s (") and "1/2 clients joined" in err and "\n" not in err


# ---------------------------------------------------------------------- torchrun
def _torchrun(tmp_path: Path, fault: str, *args: str, restarts: int = 0, timeout: float = 120,
              until: str | None = None) -> tuple[int | None, str, str, float]:
    """torchrun running this file on 2 processes: its exit code, stdout, stderr and the time it
    ended; with ``until``, the time a line of stderr starts with it, and then the job is killed
    (torchrun would give a stopped worker 30 s to answer its SIGTERM)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTIC_FAULT": fault, "ELASTIC_PIDS": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "--monitor-interval=0.2", __file__, "train",
           "--preset", "copy", *[a for o in TINY for a in ("--set", o)], *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()

    def kill() -> None:
        """torchrun, and its workers (each in a session of its own) by the pids they wrote,
        each only while it still runs this test (a pid is not reused for another process)."""
        for pid in [proc.pid] + [int(f.read_text()) for f in tmp_path.glob("pid-*")]:
            try:
                if str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    err: list[str] = []
    at = None
    try:
        for line in proc.stderr:
            err.append(line)
            if until is not None and line.startswith(until):
                at = time.time()
                kill()
        proc.wait()
        reader.join(5)
    finally:
        watchdog.cancel()
        kill()
    return proc.returncode, "".join(out), "".join(err), at or time.time()


def _reference_on_rank(rank: int, run_dir: str, overrides: list[str]) -> None:
    from blockformer.train import train  # noqa: PLC0415

    train(copy_config(*overrides), Path(run_dir), **QUIET)


@pytest.mark.slow
def test_a_killed_rank_under_max_restarts_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path):
    from parallel_helpers import run_ranks  # noqa: PLC0415

    run = ["train.steps=24", "train.eval_every=5"]
    run_ranks(2, _reference_on_rank, str(tmp_path / "ref"), run)  # the same 2-rank FSDP run, never stopped
    # rank 0 (the one owning the run directory and its lock) is SIGKILLed as it starts step 13:
    # the last checkpoint is step 10; torchrun reruns the same command, which resumes from it
    code, out, err, _ = _torchrun(tmp_path, "kill:0:13", *[a for o in run for a in ("--set", o)],
                                  "--resume-if-exists", "--out", str(tmp_path / "run"), restarts=1)
    assert code == 0, err[-3000:]
    assert out.count("train.resume=auto: continuing from step-000010") == 1
    before_kill = train_losses(tmp_path / "attempt-0")  # rank 0's metrics as it was killed
    assert sorted(before_kill) == list(range(1, 13))
    ref, got = train_losses(tmp_path / "ref"), train_losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 25))
    assert all(got[s] == before_kill[s] for s in range(11, 13))  # the steps both attempts ran: bit for bit
    assert got == ref  # and every step, bit for bit: data position, RNG, AdamW moments all came back
    assert [p.name for p in sorted((tmp_path / "run").glob("step-*"))] == ["step-000020", "step-000024"]


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_after_the_timeout_with_a_line_naming_it(tmp_path):
    # rank 1 is SIGSTOPped (alive, silent) as it starts step 3; rank 0 waits parallel.timeout=5 s
    _, _, err, said = _torchrun(tmp_path, "stop:1:3", "--set", "train.steps=50", "--set", "train.eval_every=0",
                                "--set", "parallel.timeout=5", "--out", str(tmp_path / "run"), timeout=60,
                                until="blockformer train: error:")
    line = err.splitlines()[-1]
    assert line.startswith("blockformer train: error: parallel: rank 1 of 2 stopped answering: rank 0 waited "
                           "parallel.timeout=5s in a collective (Timed out waiting 5000ms for "), err[-3000:]
    assert "and no word came from it within 2.5s (hung, stopped or dead)" in line
    assert "Traceback" not in err  # one line, not a wall
    assert said - float((tmp_path / "fault-at").read_text()) < 5 + 2.5 + 5  # the timeout, the wait, slack


# ---------------------------------------------------------------------- the worker torchrun starts
def _with_fault() -> None:
    """``ELASTIC_FAULT=kill|stop:RANK:N``: that rank kills or stops itself as it starts its N-th
    step, in the first attempt; a killed rank 0 first keeps its metrics as ``attempt-0``."""
    what, rank, step = os.environ["ELASTIC_FAULT"].split(":")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ["RANK"] != rank:
        return
    from blockformer.train import loop  # noqa: PLC0415

    original, calls = loop.train_step, []
    out = Path(sys.argv[sys.argv.index("--out") + 1])

    def train_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(step):
            (out.parent / "fault-at").write_text(repr(time.time()))
            if what == "kill":
                (out.parent / "attempt-0").mkdir(exist_ok=True)
                shutil.copy(out / "metrics.jsonl", out.parent / "attempt-0" / "metrics.jsonl")
            os.kill(os.getpid(), signal.SIGKILL if what == "kill" else signal.SIGSTOP)
        return original(*args, **kwargs)

    loop.train_step = train_step


if __name__ == "__main__":
    pid_file = Path(os.environ["ELASTIC_PIDS"]) / f"pid-{os.environ['TORCHELASTIC_RESTART_COUNT']}-{os.environ['RANK']}"
    pid_file.write_text(str(os.getpid()))
    _with_fault()
    from blockformer.cli import main  # noqa: PLC0415

    sys.exit(main(sys.argv[1:]))
