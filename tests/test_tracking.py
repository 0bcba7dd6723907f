"""train.report_to: metrics.jsonl always; TensorBoard's event files hold the same numbers at
the same steps, read back with TensorBoard's own EventAccumulator."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402

from blockformer.cli import main  # noqa: E402
from blockformer.errors import UsageError  # noqa: E402
from blockformer.run_config import RunConfig, load_run_config  # noqa: E402
from blockformer.train import train  # noqa: E402
from blockformer.train.metrics import read_metrics  # noqa: E402

from test_train_loop import QUIET, tiny_lm  # noqa: E402

BOARD = "train.report_to=jsonl,tensorboard"


def events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def logged(run_dir, split: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r["split"] == split and key in r]


def assert_same(board: list[tuple[int, float]], jsonl: list[tuple[int, float]], rel: float = 0.0) -> None:
    """Same steps, each once; values equal to 1e-6 (event files store float32)."""
    assert [s for s, _ in board] == [s for s, _ in jsonl]
    for (_, a), (_, b) in zip(board, jsonl):
        assert a == pytest.approx(b, abs=1e-6, rel=rel)


def test_event_files_hold_the_train_and_val_losses_of_metrics_jsonl(tmp_path):
    cfg = tiny_lm(tmp_path, "train.steps=6", "train.eval_every=3", "train.log_every=2", BOARD)
    train(cfg, tmp_path / "run", **QUIET)
    acc = events(tmp_path / "run")
    assert_same(scalar(acc, "train/loss"), logged(tmp_path / "run", "train", "loss"))
    assert_same(scalar(acc, "val/loss"), logged(tmp_path / "run", "val", "val_loss"))
    assert [s for s, _ in scalar(acc, "train/loss")] == [2, 4, 6]
    assert [s for s, _ in scalar(acc, "val/loss")] == [3, 6]
    for tag, key in [("train/lr", "lr"), ("train/grad_norm", "grad_norm"), ("train/tokens_per_s", "tokens_per_s"),
                     ("val/ppl", "val_ppl")]:
        assert_same(scalar(acc, tag), logged(tmp_path / "run", tag.split("/")[0], key), rel=1e-6)
    assert all(norm > 0 for _, norm in logged(tmp_path / "run", "train", "grad_norm"))


def test_the_run_config_is_in_the_hparams_with_the_losses_as_its_metrics(tmp_path):
    cfg = tiny_lm(tmp_path, "train.steps=2", "train.eval_every=0", BOARD)
    train(cfg, tmp_path / "run", **QUIET)
    content = events(tmp_path / "run").PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["model.d_model"].number_value == 32 and hp["model.n_layers"].number_value == 1
    assert hp["train.steps"].number_value == 2 and hp["data.tokenizer"].string_value == "char"
    assert json.loads(hp["train.report_to"].string_value) == ["jsonl", "tensorboard"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"train/loss", "val/loss"}


def test_a_resumed_run_appends_and_its_steps_are_not_duplicated(tmp_path):
    """Resumed from step 3 of a finished 6-step run: TensorBoard purges the first run's steps
    after 3, as metrics.jsonl drops its lines; each step is there once, with the new value."""
    cfg = tiny_lm(tmp_path, "train.steps=6", "train.eval_every=3", "train.log_every=1", BOARD)
    run = tmp_path / "run"
    train(cfg, run, **QUIET)
    train(cfg, run, resume=run / "step-000003", **QUIET)
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per call
    acc = events(run)
    assert_same(scalar(acc, "train/loss"), logged(run, "train", "loss"))
    assert [s for s, _ in scalar(acc, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in scalar(acc, "val/loss")] == [3, 6]


def test_the_default_writes_metrics_jsonl_and_no_tensorboard_directory(tmp_path):
    cfg = tiny_lm(tmp_path, "train.steps=2", "train.eval_every=0")
    assert cfg.train.report_to == ["jsonl"]
    train(cfg, tmp_path / "run", **QUIET)
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and not (tmp_path / "run" / "tensorboard").exists()
    train(tiny_lm(tmp_path, "train.steps=2", "train.eval_every=0", "train.report_to=tensorboard"), tmp_path / "tb",
          **QUIET)  # jsonl is implied
    assert read_metrics(tmp_path / "tb") and (tmp_path / "tb" / "tensorboard").is_dir()


def test_a_record_gives_one_tag_per_number_and_per_entry_of_a_list():
    """MoE routing: expert_load is a list, one TensorBoard scalar per expert."""
    from blockformer.train.tracking import scalars

    record = {"split": "train", "step": 5, "loss": 2.5, "expert_load": [0.25, 0.75], "dropped": 0, "note": "x"}
    assert dict(scalars(record)) == {"train/loss": 2.5, "train/expert_load/0": 0.25, "train/expert_load/1": 0.75,
                                     "train/dropped": 0.0}
    assert dict(scalars({"split": "val", "step": 5, "val_loss": 2.0, "exact_match": 0.5})) == {
        "val/loss": 2.0, "val/exact_match": 0.5}


@pytest.mark.parametrize("value, words", [
    (["wandb"], ["unknown entry 'wandb'"]),
    (["jsonl", "tensorbaord"], ["unknown entry 'tensorbaord'", "did you mean 'tensorboard'"]),
    ("tensorboard", ["train.report_to='tensorboard'"]),  # a TOML string, not a list
])
def test_an_unknown_report_to_entry_is_one_line_naming_the_field_and_the_choices(value, words):
    with pytest.raises(UsageError) as e:
        RunConfig.from_dict({"train": {"report_to": value}})
    message = str(e.value)
    assert "\n" not in message and message.startswith("train.report_to=")
    assert "expected a list of 'jsonl', 'tensorboard'" in message
    assert all(w in message for w in words), message


def test_set_takes_the_list_as_commas_or_as_a_toml_array(capsys):
    for item in ['train.report_to=jsonl,tensorboard', 'train.report_to=["jsonl","tensorboard"]',
                 "train.report_to=['jsonl', 'tensorboard']"]:
        assert load_run_config(overrides=[item]).train.report_to == ["jsonl", "tensorboard"]
    assert load_run_config(overrides=["train.sample_prompts=[INST]"]).train.sample_prompts == ["[INST]"]
    assert main(["train", "--set", "train.report_to=wandb", "--print-config"]) == 2
    assert "train.report_to=['wandb']: unknown entry 'wandb'" in capsys.readouterr().err


def test_tensorboard_asked_for_but_not_installed_names_the_extra_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(UsageError, match=r"train.report_to.*pip install 'blockformer\[tensorboard\]'") as e:
        train(tiny_lm(tmp_path, "train.steps=2", BOARD), tmp_path / "run", **QUIET)
    assert "\n" not in str(e.value) and not list((tmp_path / "run").glob("step-*"))


@pytest.fixture
def closes(monkeypatch) -> list[int]:
    """How many TensorBoard writers were closed (a writer left open may lose its last events
    when the process exits)."""
    from blockformer.train.tracking import TensorBoardReporter

    closed, close = [], TensorBoardReporter.close
    monkeypatch.setattr(TensorBoardReporter, "close", lambda self: closed.append(1) or close(self))
    return closed


def test_an_interrupted_run_closes_its_writer_with_every_step_in_it(tmp_path, closes):
    """stop_at (as Ctrl-C) ends the call between evaluations: the writer is closed, nothing lost."""
    cfg = tiny_lm(tmp_path, "train.steps=50", "train.eval_every=0", "train.log_every=1", BOARD)
    result = train(cfg, tmp_path / "run", stop_at=3, **QUIET)
    assert result.interrupted and closes == [1]
    assert [s for s, _ in scalar(events(tmp_path / "run"), "train/loss")] == [1, 2, 3]


def test_a_failed_run_closes_its_writer_with_what_it_logged(tmp_path, monkeypatch, closes):
    import blockformer.train.loop as loop

    def boom(run):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(loop, "_evaluate_and_save", boom)
    cfg = tiny_lm(tmp_path, "train.steps=50", "train.eval_every=3", "train.log_every=1", BOARD)
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "run", **QUIET)
    assert closes == [1]
    assert [s for s, _ in scalar(events(tmp_path / "run"), "train/loss")] == [1, 2, 3]


def train_with_samples(tmp_path, steps: int, eval_every: int):
    """``blockformer train`` of a tiny char model with 2 text samples, reporting to TensorBoard;
    its events."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(200)))
    sets = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.progress=false",
            f"data.text={corpus}", "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32",
            "model.max_seq_len=64", "train.batch_size=8", f"train.steps={steps}", f"train.eval_every={eval_every}",
            "train.samples=2", "train.sample_tokens=8", "train.sample_prompts=def ", BOARD]
    assert main(["train", *[a for s in sets for a in ("--set", s)], "--out", str(tmp_path / "run")]) == 0
    return events(tmp_path / "run")


def test_the_cli_logs_its_samples_as_text(tmp_path, capsys):
    acc = train_with_samples(tmp_path, steps=2, eval_every=0)
    texts = {tag: acc.Tensors(tag) for tag in acc.Tags()["tensors"] if tag.startswith("samples/")}
    assert sorted(texts) == ["samples/0/text_summary", "samples/1/text_summary"]
    printed = capsys.readouterr().out.split("-" * 60 + "\n")[1:3]  # the two samples, as printed
    for i, text in enumerate(printed):
        [event] = texts[f"samples/{i}/text_summary"]
        assert event.step == 2 and event.tensor_proto.string_val[0].decode() == f"```\n{text.removesuffix(chr(10))}\n```"


def test_each_evaluation_logs_text_samples_and_the_cli_adds_none_twice(tmp_path):
    """Samples at steps 2 and 4 (the evaluations); the command's end-of-run samples are not
    logged again at step 4."""
    acc = train_with_samples(tmp_path, steps=4, eval_every=2)
    steps = {tag: [e.step for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"] if tag.startswith("samples/")}
    assert steps == {"samples/0/text_summary": [2, 4], "samples/1/text_summary": [2, 4]}


def test_each_sweep_point_logs_its_run_and_its_summary(tmp_path):
    from blockformer.scaling.sweep import ensure_point, point_config

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"x{i} = {i % 7}\n" for i in range(300)))
    base = load_run_config(preset="stdlib-lm", overrides=[
        f"data.text={corpus}", "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16",
        "model.max_seq_len=16", "train.batch_size=4", "train.precision=fp32", BOARD])
    assert point_config(base, 32, 1, 128).train.report_to == ["jsonl", "tensorboard"]
    point = ensure_point(base, 32, 1, 128, tmp_path / "points", log=lambda *a: None)
    acc = events(tmp_path / "points" / "32x1_128")
    assert_same(scalar(acc, "val/loss"), logged(tmp_path / "points" / "32x1_128", "val", "val_loss"))
    assert scalar(acc, "sweep/val_loss") == [(point.steps, pytest.approx(point.val_loss, abs=1e-6))]
    assert scalar(acc, "sweep/parameters") == [(point.steps, pytest.approx(point.parameters, rel=1e-6))]


def _train_ddp(rank: int, tmp: str) -> None:
    from test_parallel_dp import lm_config

    train(lm_config(Path(tmp), "parallel.dp_replicate=2", BOARD), Path(tmp) / "ddp", log=lambda *a: None)


@pytest.mark.slow
def test_a_parallel_run_has_one_writer_rank_0(tmp_path):
    from parallel_helpers import run_ranks

    run_ranks(2, _train_ddp, str(tmp_path))
    assert len(list((tmp_path / "ddp" / "tensorboard").iterdir())) == 1
    acc = events(tmp_path / "ddp")
    assert_same(scalar(acc, "train/loss"), logged(tmp_path / "ddp", "train", "loss"))
    assert [s for s, _ in scalar(acc, "train/loss")] == [1, 2, 3]
