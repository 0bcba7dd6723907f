"""A kept checkpoint is always finite. A learning rate so large that an update overflows
(finite loss, finite gradients, non-finite weights), finite weights that overflow in the
forward pass (a NaN validation loss), or inf gradients under a finite loss never reach a
checkpoint: ``stop`` exits 3 naming the last finite checkpoint, which resumes;
``skip`` goes back to it (or to the start) and ends with a finite validation loss."""

import math
import re

import pytest
import safetensors.torch
import torch

from blockformer.cli import main
from blockformer.train import checkpoint as ck
from blockformer.train import compile as compile_module
from blockformer.train import train
from blockformer.train.finite import finite_weights
from blockformer.train.loop import NonFiniteLoss, train_step
from blockformer.train.optim import build_optimizer
from blockformer.precision import grad_scaler
from blockformer.train.setup import build_run

from test_train_loop import QUIET, TINY, tiny_lm

BF16_WARNING = "ignore:precision 'bf16' on a CPU without bf16 units"


def _weights(path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path / "model.safetensors"))


def _all_finite(run) -> None:
    """Every checkpoint on disk holds finite weights only."""
    for path in ck.step_checkpoints(run):
        for name, t in _weights(path).items():
            assert torch.isfinite(t).all(), f"{path}: {name}"


def _overflow_at(monkeypatch, k: int) -> None:
    """The ``k``-th optimizer update (of this test) overflows a weight, as an lr of 1e39 does,
    while its loss and gradients stay finite."""
    original, calls = torch.optim.AdamW.step, []

    def step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == k:
            with torch.no_grad():
                self.param_groups[0]["params"][0].mul_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def _cli_args(tmp_path, *overrides):
    corpus = tmp_path / "corpus.txt"
    tiny_lm(tmp_path)  # writes the corpus
    items = [*TINY, f"data.text={corpus}", "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}",
             "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8", *overrides]
    return [a for item in items for a in ("--set", item)]


# ------------------------------------------------------------------ a learning rate that blows up
@pytest.mark.parametrize("lr", ["1e6", "1e39"])  # 1e6: finite weights, NaN forward; 1e39: inf weights
def test_a_run_that_blows_up_at_once_saves_nothing_non_finite_and_stops(tmp_path, lr):
    cfg = tiny_lm(tmp_path, "train.steps=4", "train.eval_every=1", f"train.lr={lr}", "train.warmup=0")
    with pytest.raises(NonFiniteLoss, match=r"NaN or infinite by step 1 .*Last finite checkpoint: none"):
        train(cfg, tmp_path / "run", **QUIET)
    assert ck.step_checkpoints(tmp_path / "run") == []


@pytest.mark.parametrize("lr", ["1e6", "1e39"])
def test_skip_goes_back_to_the_start_and_ends_finite(tmp_path, lr):
    cfg = tiny_lm(tmp_path, "train.steps=4", "train.eval_every=2", f"train.lr={lr}", "train.warmup=0",
                  "train.nonfinite=skip")
    result = train(cfg, tmp_path / "run", **QUIET)
    assert result.step == 4 and result.restored == 2  # both evaluations found the run diverged
    assert math.isfinite(result.val["val_loss"]) and result.val["val_loss"] < math.log(29) + 0.5
    _all_finite(tmp_path / "run")
    # back at the start each time: both checkpoints hold the initial weights
    first, last = (_weights(p) for p in ck.step_checkpoints(tmp_path / "run"))
    assert all(torch.equal(first[n], last[n]) for n in first)


# ------------------------------------------------------------------ an update that overflows mid-run
@pytest.mark.parametrize("precision, compiled", [("fp32", False), ("bf16", False), ("fp32", True)])
@pytest.mark.filterwarnings(BF16_WARNING)
def test_stop_names_the_last_finite_checkpoint_and_resuming_from_it_works(
        tmp_path, capsys, monkeypatch, precision, compiled):
    if compiled:
        torch._dynamo.reset()
        monkeypatch.setattr(compile_module, "BACKEND", "eager")
    run = tmp_path / "run"
    args = _cli_args(tmp_path, "train.steps=5", "train.eval_every=1", f"train.precision={precision}",
                     f"train.compile={str(compiled).lower()}")
    _overflow_at(monkeypatch, 3)
    assert main(["train", "--out", str(run), *args]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the weights became NaN or infinite by step 3" in err, err
    named = re.search(r"Last finite checkpoint: (\S+)\. ", err).group(1)
    assert named == str(run / "step-000002")
    assert [p.name for p in ck.step_checkpoints(run)] == ["step-000001", "step-000002"]
    _all_finite(run)
    monkeypatch.undo()
    if compiled:
        monkeypatch.setattr(compile_module, "BACKEND", "eager")
    assert main(["train", "--resume", named, "--out", str(run)]) == 0
    assert [p.name for p in ck.step_checkpoints(run)][-1] == "step-000005"
    _all_finite(run)
    torch._dynamo.reset()


def test_skip_restores_the_last_finite_checkpoint_exactly(tmp_path, monkeypatch):
    cfg = tiny_lm(tmp_path, "train.steps=6", "train.eval_every=2", "train.nonfinite=skip",
                  "train.keep_last=5")
    _overflow_at(monkeypatch, 3)
    result = train(cfg, tmp_path / "run", **QUIET)
    assert result.step == 6 and result.restored == 1 and math.isfinite(result.val["val_loss"])
    _all_finite(tmp_path / "run")
    two, four, six = (_weights(p) for p in ck.step_checkpoints(tmp_path / "run"))
    assert all(torch.equal(two[n], four[n]) for n in two)  # step 4 is step 2's weights, put back
    assert not all(torch.equal(four[n], six[n]) for n in four)  # and training went on from there


# ------------------------------------------------------------------ inf gradients under a finite loss
@pytest.mark.parametrize("kernel", ["fused", "foreach"])
@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_an_inf_gradient_under_a_finite_loss_makes_no_update(tmp_path, kernel, grad_clip):
    cfg = tiny_lm(tmp_path, "train.steps=4", f"train.grad_clip={grad_clip}")
    device = torch.device("cpu")
    run = build_run(cfg, device, log=lambda *a: None)
    model, objective = run.model, run.objective
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.train)
    if kernel == "foreach":
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, foreach=True)
    scaler = grad_scaler("fp32", device)
    train_step(model, objective, [objective.next_batch()], optimizer, scaler, params, cfg.train, device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hook = params[-1].register_hook(lambda g: g * float("inf"))
    batch = objective.next_batch()
    loss = train_step(model, objective, [batch], optimizer, scaler, params, cfg.train, device,
                      check_finite=True)
    hook.remove()
    assert loss is None if kernel == "foreach" else not torch.isfinite(loss)  # read as a skipped step
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert finite_weights(params)


def test_finite_weights_sees_one_bad_value_and_not_large_finite_ones():
    params = [torch.nn.Parameter(torch.full((3, 3), 1e30)), torch.nn.Parameter(torch.zeros(4))]
    assert finite_weights(params)  # 1e30 squared overflows the 2-norm: checked again exactly
    for bad in (float("nan"), float("inf"), -float("inf")):
        with torch.no_grad():
            params[1][2] = bad
        assert not finite_weights(params)
