"""Checkpoint averaging: exact means of the weights, a loadable result, the --last N form
over a run directory, and one-line errors for checkpoints that cannot be averaged."""

import json

import pytest
import safetensors.torch
import torch

from blockformer import build_model
from blockformer.cli import main
from blockformer.errors import UsageError
from blockformer.run_config import load_run_config
from blockformer.tokenizers import CharTokenizer
from blockformer.train import load_checkpoint, save_checkpoint
from blockformer.train.average import average_checkpoints, average_state, last_checkpoints

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64"]


def _ckpt(directory, seed, extra=()):
    cfg = load_run_config(preset="reverse", overrides=[*TINY, *extra])
    model = build_model(cfg.model, seed=seed)
    return save_checkpoint(directory, model, CharTokenizer("abcdefghij"), cfg, {"step": seed})


def _weights(path):
    return safetensors.torch.load_file(str(path / "model.safetensors"))


def test_average_of_two_is_exactly_their_mean(tmp_path):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    out = average_checkpoints([a, b], tmp_path / "avg")
    wa, wb, avg = _weights(a), _weights(b), _weights(out)
    assert avg.keys() == wa.keys()
    for name, t in avg.items():
        assert t.dtype == wa[name].dtype
        assert torch.equal(t, ((wa[name].double() + wb[name].double()) / 2).float()), name
        if t.dim() == 2:  # random matrices: seeds 0 and 1 differ, so the mean is neither
            assert not torch.equal(t, wa[name]) and not torch.equal(t, wb[name])
    # The result is an ordinary checkpoint; tied weights (shared embeddings) stay tied.
    ckpt = load_checkpoint(out)
    model = ckpt.model
    assert model.head.weight is model.tgt_embed.tokens.weight
    assert "head.weight" in avg and "tgt_embed.tokens.weight" not in avg  # safetensors keeps one name
    torch.testing.assert_close(model.src_embed.tokens.weight, avg["head.weight"], rtol=0, atol=0)
    assert json.loads((out / "averaged_from.json").read_text()) == [str(a), str(b)]
    assert not (out / "trainer_state.pt").exists()  # for translating, not for resuming


def test_average_of_three_and_of_one_checkpoint_with_itself(tmp_path):
    paths = [_ckpt(tmp_path / f"c{s}", s) for s in range(3)]
    state = average_state([p / "model.safetensors" for p in paths])
    ws = [_weights(p) for p in paths]
    for name, t in state.items():
        mean = sum(w[name].double() for w in ws) / 3
        assert torch.equal(t, mean.float())
    same = average_state([paths[0] / "model.safetensors"] * 2)
    assert all(torch.equal(same[n], ws[0][n]) for n in same)  # x + x over 2 is x, exactly


def test_last_n_over_a_run_directory_through_the_cli(tmp_path, capsys):
    run = tmp_path / "run"
    steps = [_ckpt(run / f"step-{s:06d}", s) for s in (100, 200, 300)]
    out = tmp_path / "avg2"
    assert main(["average", "--run", str(run), "--last", "2", "--output", str(out)]) == 0
    assert f"averaged 2 checkpoints -> {out}" in capsys.readouterr().out
    assert last_checkpoints(run, 2) == steps[1:]
    w1, w2, avg = _weights(steps[1]), _weights(steps[2]), _weights(out)
    assert all(torch.equal(avg[n], ((w1[n].double() + w2[n].double()) / 2).float()) for n in avg)

    out_list = tmp_path / "avg-list"
    assert main(["average", "--checkpoints", str(steps[1]), str(steps[2]), "--output", str(out_list)]) == 0
    assert all(torch.equal(_weights(out_list)[n], avg[n]) for n in avg)


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda p: ["--run", str(p / "run"), "--last", "5"], "2 step checkpoints, fewer than --last 5"),
        (lambda p: ["--checkpoints", str(p / "run" / "step-000001"), str(p / "other")], "model config differs"),
        (lambda p: ["--checkpoints", str(p / "run" / "step-000001"), "--run", str(p / "run"), "--last", "1"],
         "not both"),
        (lambda p: [], "--checkpoints: missing"),
        (lambda p: ["--checkpoints", str(p / "nowhere")], "checkpoint directory not found"),
    ],
)
def test_bad_averaging_requests_exit_2(tmp_path, capsys, make_args, message):
    _ckpt(tmp_path / "run" / "step-000001", 1)
    _ckpt(tmp_path / "run" / "step-000002", 2)
    _ckpt(tmp_path / "other", 3, extra=["model.d_ff=128"])
    assert main(["average", *make_args(tmp_path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_output_cannot_overwrite_an_input(tmp_path):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    with pytest.raises(UsageError, match="is one of the checkpoints being averaged"):
        average_checkpoints([a, b], a)
