"""The training loop: it learns, resumes exactly, stops cleanly on a signal, logs and plots."""

import json
import math
import os
import signal

import pytest
import torch

from blockformer.errors import UsageError
from blockformer.run_config import load_run_config
from blockformer.train import train
from blockformer.train.load import load_checkpoint, load_trainer_state
from blockformer.train.objective import LanguageModelling

QUIET = dict(log=lambda *a: None)
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.progress=false"]


def tiny_task(*overrides: str):
    task = ["data.task_max_len=6", "data.heldout=50", "train.eval_samples=20", "train.batch_size=16"]
    return load_run_config(preset="copy", overrides=[*TINY, *task, *overrides])


def tiny_lm(tmp_path, *overrides: str):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(200)))
    cache = tmp_path / "cache"
    data = [f"data.text={corpus}", "data.tokenizer=char", f"data.cache_dir={cache}", "data.seq_len=32"]
    return load_run_config(overrides=[*TINY, *data, "model.max_seq_len=32", "train.batch_size=8", *overrides])


def tiny_pairs(tmp_path, *overrides: str):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 8, (200,), generator=g).tolist()
    src = ["".join("abcdef"[i] for i in torch.randint(6, (n,), generator=g).tolist()) for n in lengths]
    (tmp_path / "p.src").write_text("\n".join(src) + "\n")
    (tmp_path / "p.tgt").write_text("\n".join(s[::-1] for s in src) + "\n")
    data = ["data.tokenizer=char", f"data.src={tmp_path / 'p.src'}", f"data.tgt={tmp_path / 'p.tgt'}"]
    model = ["model.arch=encoder-decoder", "model.max_seq_len=32"]
    return load_run_config(overrides=[*TINY, *model, *data, "train.max_tokens=64", *overrides])


def test_a_short_copy_run_drives_the_loss_down(tmp_path):
    """80 steps of a tiny model: the mean loss of the last 5 steps is at least 0.5 nats below
    that of the first 5 (~ln 14 = 2.64 at initialisation)."""
    cfg = tiny_task("train.steps=80", "train.eval_every=0", "train.lr=3e-3", "train.warmup=10")
    result = train(cfg, tmp_path / "run", **QUIET)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert first > 2.3
    assert last < first - 0.5, result.losses[::10]


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_resume_with_another_learning_rate_uses_it(tmp_path, schedule):
    """The saved optimizer and scheduler states carry the old train.lr; a resume with
    --set train.lr=... continues the schedule's position at the new rate, not the old one."""
    base = ("train.eval_every=0", "train.log_every=1", f"train.schedule={schedule}", "train.warmup=2",
            "train.min_lr=1e-5")
    train(tiny_task("train.steps=4", "train.lr=1e-3", *base), tmp_path / "run", **QUIET)
    cfg = tiny_task("train.steps=8", "train.lr=0.25", *base)
    train(cfg, tmp_path / "run", resume=tmp_path / "run", **QUIET)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if r.get("split") == "train"}
    from blockformer.train.schedule import lr_lambda

    factor = lr_lambda(cfg.train, cfg.model.d_model)
    for step in range(5, 9):  # the lr logged at a step is the one its update used
        assert lrs[step] == pytest.approx(0.25 * factor(step - 1), rel=1e-12), (step, lrs)


@pytest.mark.slow
def test_a_short_copy_run_learns_the_task(tmp_path):
    """Loss from ~ln(14) = 2.6 at initialisation to below 0.5 in 250 steps; half the held-out
    sequences already copied exactly."""
    cfg = tiny_task("train.steps=250", "train.eval_every=0", "train.lr=3e-3", "train.warmup=20",
                    "model.d_model=64", "model.d_ff=128", "train.batch_size=32")
    result = train(cfg, tmp_path / "run", **QUIET)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert first > 2.3
    assert last < 0.5, result.losses[::25]
    assert result.val["exact_match"] >= 0.5
    assert result.val["val_loss"] < 0.5


@pytest.mark.parametrize("kind", ["lm", "task", "pairs"])
def test_resume_continues_exactly(tmp_path, kind):
    """20 steps in one go == 10 steps, stop, resume, 10 more: loss for loss, bit for bit
    (dropout, gradient accumulation and the data position included)."""
    extra = ("train.steps=20", "train.eval_every=0", "train.log_every=3", "train.grad_accum=2",
             "train.warmup=5", "model.dropout=0.1")
    make = {"lm": lambda: tiny_lm(tmp_path, *extra), "task": lambda: tiny_task(*extra),
            "pairs": lambda: tiny_pairs(tmp_path, *extra)}[kind]
    cfg = make()
    straight = train(cfg, tmp_path / "a", **QUIET)
    first = train(cfg, tmp_path / "b", stop_at=10, **QUIET)
    assert first.interrupted and first.step == 10 and first.checkpoint.name == "step-000010"
    second = train(cfg, tmp_path / "b", resume=tmp_path / "b", **QUIET)
    assert (len(first.losses), len(second.losses), second.step) == (10, 10, 20)
    assert first.losses + second.losses == straight.losses
    a, b = load_checkpoint(straight.checkpoint), load_checkpoint(second.checkpoint)
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path, monkeypatch):
    cfg = tiny_lm(tmp_path, "train.steps=8", "train.eval_every=0")
    straight = train(cfg, tmp_path / "a", **QUIET)
    original = LanguageModelling.next_batch
    calls = []

    def next_batch(self):
        calls.append(1)
        if len(calls) == 3:  # during step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(LanguageModelling, "next_batch", next_batch)
    stopped = train(cfg, tmp_path / "b", **QUIET)
    monkeypatch.undo()
    assert stopped.interrupted and stopped.step == 3 and load_trainer_state(stopped.checkpoint)["step"] == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is restored
    resumed = train(cfg, tmp_path / "b", resume=stopped.checkpoint, **QUIET)
    assert stopped.losses + resumed.losses == straight.losses


def test_max_minutes_stops_after_the_budget_and_saves(tmp_path, monkeypatch):
    from blockformer.train import loop

    clock = {"t": 0.0}
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock["t"])
    original = loop.train_step

    def step(*args, **kwargs):
        clock["t"] += 25.0  # each step "takes" 25 s
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step)
    cfg = tiny_lm(tmp_path, "train.steps=50", "train.eval_every=0", "train.max_minutes=1")
    result = train(cfg, tmp_path / "run", **QUIET)
    assert result.interrupted and result.step == 3  # 50 s < 60 s after two steps, 75 s after three
    assert load_trainer_state(result.checkpoint)["step"] == 3


def test_metrics_evaluations_checkpoints_and_plot(tmp_path):
    cfg = tiny_lm(tmp_path, "train.steps=12", "train.eval_every=4", "train.log_every=2", "train.keep_last=2",
                  "train.lr=3e-3")
    result = train(cfg, tmp_path / "run", **QUIET)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert train_steps == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in val] == [4, 8, 12]
    for r in val:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    assert all(r["lr"] > 0 and r["tokens_per_s"] > 0 for r in records if r["split"] == "train")
    best_step = min(val, key=lambda r: r["val_loss"])["step"]
    assert os.readlink(tmp_path / "run" / "best") == f"step-{best_step:06d}"
    kept = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-"))
    assert kept == sorted({f"step-{best_step:06d}", "step-000008", "step-000012"})
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "run" / "config.toml").is_file()
    best_loss = min(r["val_loss"] for r in val)
    assert load_trainer_state(result.checkpoint)["best_val_loss"] == pytest.approx(best_loss)


def test_bf16_autocast_trains_on_cpu_and_fp16_is_refused(tmp_path):
    result = train(tiny_task("train.steps=3", "train.precision=bf16"), tmp_path / "bf16", **QUIET)
    assert all(math.isfinite(x) for x in result.losses) and len(result.losses) == 3
    with pytest.raises(UsageError, match="train.precision='fp16': needs a CUDA device"):
        cfg = tiny_task("train.steps=3", "train.precision=fp16", "train.device=cpu")
        train(cfg, tmp_path / "fp16", **QUIET)


def test_data_and_architecture_must_agree(tmp_path):
    with pytest.raises(UsageError, match="model.arch='decoder': data.task='copy' trains an encoder-decoder"):
        train(tiny_task("model.arch=decoder"), tmp_path / "x", **QUIET)
    with pytest.raises(UsageError, match="data.text: no text given"):
        train(load_run_config(overrides=["data.text="]), tmp_path / "y", **QUIET)
