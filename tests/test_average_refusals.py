"""``average`` over checkpoints whose weights cannot be averaged: differing tensor names or
shapes, tensors the config's model lacks, truncated or garbled files, non-finite weights.
Each is one line naming the checkpoint file (and the tensor), exit code 2, nothing written."""

import os

import pytest
import safetensors.torch
import torch

from blockformer.cli import main

from test_average import _ckpt

WEIGHTS = "model.safetensors"


def _edit(file, change) -> str:
    """Rewrite a safetensors file through ``change(state) -> name``; returns the tensor's name."""
    state = safetensors.torch.load_file(str(file))
    name = change(state)
    safetensors.torch.save_file(state, str(file))
    return name


def _renamed(state):
    name = sorted(state)[0]
    state["renamed." + name] = state.pop(name)
    return "renamed." + name


def _extra(state):
    state["extra.weight"] = torch.zeros(3)
    return "extra.weight"


def _narrowed(state):
    name = next(n for n in sorted(state) if state[n].dim() == 2)
    state[name] = state[name][:, :-1].contiguous()
    return name


def _nan(state):
    name = next(n for n in sorted(state) if state[n].dim() == 2)
    state[name][0, 0] = float("nan")
    return name


def _truncated(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _random_bytes(file):
    file.write_bytes(os.urandom(4096))


def _average(tmp_path, capsys, a, b) -> str:
    out = tmp_path / "avg"
    assert main(["average", "--checkpoints", str(a), str(b), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()
    return err


@pytest.mark.parametrize("change, message", [
    (_renamed, "differ from"),  # one checkpoint names a tensor differently
    (_extra, "differ from"),  # one checkpoint has a tensor more
    (_narrowed, "but torch.float32"),  # one checkpoint has a tensor of another shape
    (_nan, "NaN or infinite"),
])
def test_one_checkpoint_unlike_the_other_is_named_with_its_tensor(tmp_path, capsys, change, message):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    name = _edit(b / WEIGHTS, change)
    err = _average(tmp_path, capsys, a, b)
    assert f"{b / WEIGHTS}:" in err and message in err
    assert name in err or name.removeprefix("renamed.") in err


@pytest.mark.parametrize("change, message", [
    (_extra, "is not in the model its config.json describes"),
    (_narrowed, "but the model its config.json describes has"),
])
def test_checkpoints_alike_but_unlike_their_config_are_named_with_the_tensor(
        tmp_path, capsys, change, message):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    name = _edit(a / WEIGHTS, change)
    assert _edit(b / WEIGHTS, change) == name
    err = _average(tmp_path, capsys, a, b)
    assert f"{a / WEIGHTS}: tensor {name} " in err and message in err


@pytest.mark.parametrize("damage", [_truncated, _random_bytes, lambda f: f.write_bytes(b"\x05")])
@pytest.mark.parametrize("which", [0, 1])
def test_a_truncated_or_garbled_weights_file_is_named(tmp_path, capsys, damage, which):
    paths = [_ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)]
    damage(paths[which] / WEIGHTS)
    err = _average(tmp_path, capsys, *paths)
    assert f"{paths[which] / WEIGHTS}: cannot read the weights" in err


def test_a_missing_weights_file_is_named(tmp_path, capsys):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    (b / WEIGHTS).unlink()
    assert f"{b / WEIGHTS}: weights file not found" in _average(tmp_path, capsys, a, b)
