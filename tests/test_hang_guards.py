"""Configs too big to build are described from arithmetic or refused in one line, in seconds."""

import dataclasses
import time

import pytest

from blockformer.cli import main
from blockformer.config import TransformerConfig
from blockformer.data.tasks import make_task
from blockformer import stats as memory
from blockformer.stats import _measured, size_estimate


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _timed_main(args: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    rc = main(args)
    return rc, time.perf_counter() - start


@pytest.mark.parametrize("cfg", [
    TransformerConfig(arch="decoder", d_model=32, n_heads=2, n_layers=11, vocab_size=50),
    TransformerConfig(arch="encoder-decoder", d_model=32, n_heads=2, n_encoder_layers=9,
                      n_decoder_layers=5, vocab_size=50, position="relative"),
    TransformerConfig(arch="decoder", d_model=32, n_heads=2, n_layers=7, vocab_size=50,
                      ffn="swiglu", ffn_experts=4, experts_top_k=1, shared_experts=1, tie_embeddings=False),
], ids=["decoder", "encoder-decoder-relative", "moe"])
def test_a_deep_config_extrapolated_from_two_small_depths_equals_the_built_one(cfg, monkeypatch):
    monkeypatch.setattr(memory, "EXACT_LAYERS", 4)  # extrapolate from depth 5 up
    assert cfg.total_layers > memory.EXACT_LAYERS
    assert size_estimate(cfg, 3, 16) == _measured(cfg, 3, 16)


def test_info_describes_a_million_layers_from_arithmetic_in_seconds(capsys):
    rc, seconds = _timed_main(["info", "--preset", "char-lm-tiny", "--json",
                               *_sets("model.n_layers=1000000")])
    assert rc == 0 and seconds < 10, seconds
    import json

    info = json.loads(capsys.readouterr().out)
    small = size_estimate(dataclasses.replace(TransformerConfig(**_tiny_model()), n_layers=2), 12, 64)
    step = size_estimate(dataclasses.replace(TransformerConfig(**_tiny_model()), n_layers=3), 12, 64)
    per_layer = step["parameters"] - small["parameters"]
    assert info["parameters"] == small["parameters"] + (1_000_000 - 2) * per_layer
    assert info["memory_bytes"]["total_bytes"] > 2**40  # terabytes: more than any test machine


def _tiny_model() -> dict:
    from blockformer.run_config import load_run_config

    return load_run_config(None, "char-lm-tiny", []).model.to_dict()


def test_info_on_a_width_whose_tensors_overflow_prints_one_line_and_exits_2(capsys):
    rc, seconds = _timed_main(["info", "--preset", "char-lm-tiny", *_sets("model.d_model=10000000000")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and seconds < 10
    assert len(err.splitlines()) == 1 and "d_model=10000000000" in err and "weights by arithmetic" in err
    assert "Traceback" not in err


def test_train_refuses_a_model_bigger_than_ram_before_building_it(tmp_path, capsys):
    rc, seconds = _timed_main(["train", "--preset", "copy", "--out", str(tmp_path / "run"),
                               *_sets("model.n_layers=1000000", "train.steps=1")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and seconds < 10, seconds
    assert len(err.splitlines()) == 1 and "GiB of RAM" in err and "parameters" in err


def test_the_ram_check_compares_the_estimate_with_the_machine(monkeypatch):
    cfg = TransformerConfig(arch="decoder", d_model=32, n_heads=2, n_layers=2, vocab_size=50)
    need = size_estimate(cfg, 4, 16)["memory_bytes"]["total_bytes"]
    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: need)
    memory.check_fits_in_memory(cfg, 4, 16, "model")  # exactly enough: accepted
    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: need - 1)
    with pytest.raises(ValueError, match=r"model: training needs about .* GiB of RAM"):
        memory.check_fits_in_memory(cfg, 4, 16, "model")


def test_a_task_of_very_long_strings_is_made_at_once():
    start = time.perf_counter()
    task = make_task("copy", min_len=3, max_len=100_000)
    assert time.perf_counter() - start < 1
    assert task.num_sources(at_most=1000) == 1000
    small = make_task("copy", min_len=1, max_len=2, alphabet="ab", n_heldout=3)
    assert small.num_sources() == 6  # exact when small


def test_train_refuses_a_task_longer_than_the_model_in_one_line(tmp_path, capsys):
    rc, seconds = _timed_main(["train", "--preset", "copy", "--out", str(tmp_path / "run"),
                               *_sets("data.task_max_len=100000", "train.steps=1")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and seconds < 10, seconds
    assert len(err.splitlines()) == 1 and "data.task_max_len" in err and "model.max_seq_len=64" in err


def test_train_refuses_a_long_task_whose_activations_exceed_ram(tmp_path, capsys):
    rc, _ = _timed_main(["train", "--preset", "copy", "--out", str(tmp_path / "run"),
                         *_sets("data.task_max_len=100000", "model.max_seq_len=200000",
                                "train.batch_size=4096", "train.steps=1")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "4096 x 100001 tokens" in err and "GiB of RAM" in err
