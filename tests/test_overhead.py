"""Per-step overhead: a training step never waits for the device (no ``.item()``, no
``.tolist()``); AdamW runs as one fused kernel; token counts are host integers."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockformer.data.labelled import IGNORE
from blockformer.data.seq2seq import collate_pairs
from blockformer.tokenizers import PAD_ID
from blockformer.train.loop import train_step
from blockformer.train.optim import build_optimizer, fused_available
from blockformer.precision import grad_scaler
from blockformer.train.setup import build_run

from test_heads import tiny_head_cfg
from test_mlm import _tiny_mlm
from test_train_loop import tiny_lm, tiny_pairs


def tiny_mlm(tmp_path, *overrides: str):
    return _tiny_mlm(tmp_path, *overrides)


def tiny_token_head(tmp_path, *overrides: str):
    """A per-token head (its target count depends on the values: IGNORE positions)."""
    path = tmp_path / "tags.tsv"
    path.write_text("".join(f"good bad the {'good' if i % 2 else 'bad'}\tP O O {'P' if i % 2 else 'O'}\n"
                            for i in range(40)))
    return tiny_head_cfg(tmp_path, f"data.labels={path}", "head.task=tokens", "model.arch=encoder", *overrides)


class HostSyncs(TorchDispatchMode):
    """Counts reads of a tensor's value on the host: on CUDA each one waits for the device.
    ``.item()``, ``int()``, ``bool()`` dispatch ``_local_scalar_dense``; ``.tolist()`` does not
    dispatch, so it is counted by wrapping it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.calls.append("item")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [tiny_lm, tiny_pairs, tiny_mlm, tiny_token_head])
def test_a_training_step_never_reads_a_device_value_on_the_host(tmp_path, monkeypatch, make):
    cfg = make(tmp_path, "train.steps=4")
    device = torch.device("cpu")
    run = build_run(cfg, device, log=lambda *a: None)
    optimizer = build_optimizer(run.model, cfg.train)
    scaler = grad_scaler("fp32", device)
    params = [p for p in run.model.parameters() if p.requires_grad]
    objective = run.objective
    losses = [train_step(run.model, objective, [objective.next_batch()], optimizer, scaler, params, cfg.train, device)]
    drawn = [[objective.next_batch(), objective.next_batch()] for _ in range(3)]  # built on the host, then moved
    counted = HostSyncs()
    original_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: counted.calls.append("tolist") or original_tolist(t))
    for batches in drawn:  # what the loop does between two log steps
        with counted:
            losses.append(train_step(run.model, objective, batches, optimizer, scaler, params, cfg.train, device,
                                     check_finite=True))  # as the loop calls it
            sum(objective.count_tokens(b) + objective.count_targets(b) for b in batches)
    assert counted.calls == []
    monkeypatch.undo()
    assert all(torch.isfinite(torch.stack(losses)).tolist())


def test_a_nonfinite_loss_makes_no_update_and_no_host_sync(tmp_path, monkeypatch):
    cfg = tiny_lm(tmp_path, "train.steps=4")
    device = torch.device("cpu")
    run = build_run(cfg, device, log=lambda *a: None)
    model, objective = run.model, run.objective
    optimizer, scaler = build_optimizer(model, cfg.train), grad_scaler("fp32", device)
    params = list(model.parameters())
    train_step(model, objective, [objective.next_batch()], optimizer, scaler, params, cfg.train, device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in optimizer.state[params[0]].items()}
    monkeypatch.setattr(type(objective), "loss", lambda self, m, b, ls=0.0: m(b[0]).sum() * float("nan"))
    batch = objective.next_batch()
    with HostSyncs() as counted:
        loss = train_step(model, objective, [batch], optimizer, scaler, params, cfg.train, device, check_finite=True)
    assert counted.calls == []
    assert loss is not None and not torch.isfinite(loss)  # reported, read at the next log step
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # the fused step left the weights alone
    for k, v in optimizer.state[params[0]].items():
        assert torch.equal(v, state[k]), k  # and its moments and step count


def test_adamw_is_fused_where_torch_has_the_kernel():
    model = torch.nn.Linear(4, 4)
    from blockformer.run_config import TrainConfig  # noqa: PLC0415

    opt = build_optimizer(model, TrainConfig())
    assert fused_available(torch.device("cuda"))
    assert opt.defaults["fused"] is True  # torch >= 2.4 fuses AdamW on the CPU too
    assert not opt.defaults.get("foreach")


def test_batches_count_source_and_target_tokens_once_on_the_host():
    batch = collate_pairs([([5, 6, 7], [8]), ([5], [8, 9, 10, 11])])
    assert (batch.num_src_tokens, batch.num_tokens) == (4 + 2, 2 + 5)
    moved = batch.to("cpu", non_blocking=True)
    assert (moved.num_src_tokens, moved.num_tokens) == (6, 7)


@pytest.mark.parametrize("make", [tiny_mlm, tiny_token_head])
def test_value_dependent_counts_are_taken_on_the_host_before_the_move(tmp_path, make):
    """Masked-LM targets and per-token labels are counted from their values; the batch carries
    the count from the host, so the device copy is never read (a meta tensor cannot be)."""
    objective = build_run(make(tmp_path), torch.device("cpu"), log=lambda *a: None).objective
    state = objective.generator.get_state()
    objective.device = torch.device("meta")
    on_meta = objective.next_batch()
    objective.generator.set_state(state)
    objective.device = torch.device("cpu")
    on_cpu = objective.next_batch()  # the same draw, readable
    if make is tiny_mlm:
        assert on_meta.inputs.is_meta
        by_hand, tokens = int((on_cpu.targets != PAD_ID).sum()), on_cpu.inputs.numel()
    else:
        assert on_meta.tokens.is_meta
        by_hand, tokens = int((on_cpu.targets != IGNORE).sum()), int(on_cpu.mask.sum())
    assert 0 < by_hand < tokens
    assert objective.count_targets(on_meta) == by_hand
    assert objective.count_tokens(on_meta) == tokens
