"""Training behaviours a green suite did not pin down (issue 21, section 2): resuming in a
fresh process, the scale of a step's gradient (grad_accum, DDP, FSDP) and the MoE
auxiliary losses in the router's gradient. Each reference is written out here, by hand."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from blockformer.nn.moe import MoEFeedForward
from blockformer.run_config import load_run_config
from blockformer.train.loop import train_step
from blockformer.precision import grad_scaler
from blockformer.train.setup import build_run

from parallel_helpers import run_ranks

CPU = torch.device("cpu")
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "train.progress=false",
        "model.bias=false", "train.precision=fp32", "train.grad_clip=0", "train.compile=false"]


# ---------------------------------------------------------------------- 1. resume in a fresh process
def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "train"]


@pytest.mark.slow
def test_a_resume_in_a_new_process_restores_the_random_state(tmp_path):
    """N steps in one process, resumed to 2N in another == 2N steps in one go, loss for loss.
    Dropout draws from torch's global generator: a new process starts it from torch's default
    seed, so only the state restored from the checkpoint reproduces the masks (resuming in
    the same process would find the right state left over)."""
    N = 4
    args = ["train", "--preset", "copy", *[f"--set={o}" for o in TINY], "--set=model.dropout=0.3",
            "--set=model.attention_dropout=0.3", "--set=data.task_max_len=6", "--set=data.heldout=20",
            "--set=train.eval_samples=4", "--set=train.batch_size=8", "--set=train.schedule=constant",
            "--set=train.warmup=0", f"--set=train.eval_every={N}", "--set=train.eval_batches=1",
            "--set=train.log_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # each process sums in the same order

    def cli(*extra: str) -> None:
        command = [sys.executable, "-m", "blockformer", *extra]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]

    cli(*args, f"--set=train.steps={2 * N}", "--out", str(tmp_path / "straight"))
    cli(*args, f"--set=train.steps={N}", "--out", str(tmp_path / "split"))  # a new process resumes it
    split_dir = str(tmp_path / "split")
    cli("train", "--resume", split_dir, f"--set=train.steps={2 * N}", "--out", split_dir)
    straight, split = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert len(straight) == len(split) == 2 * N
    assert split[:N] == straight[:N]
    assert split[N:] == straight[N:]  # bit for bit: the same masks, the same data, the same weights


# ---------------------------------------------------------------------- 2. the scale of the gradient
class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step records each parameter's gradient (full, under FSDP) and
    changes nothing: what ``train_step`` hands the optimizer, before any update rule."""

    def __init__(self, params) -> None:
        super().__init__(list(params), {"lr": 0.0})
        self.grads: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure=None):
        self.grads = [_full(p.grad).clone() for g in self.param_groups for p in g["params"]]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def copy_run(*overrides: str):
    """The copy task: encoder-decoder batches whose targets are padded (id 0) to different lengths."""
    cfg = load_run_config(preset="copy", overrides=[
        *TINY, "data.task_max_len=8", "data.heldout=20", "train.batch_size=6", "train.eval_samples=4",
        *overrides])
    torch.manual_seed(0)
    return cfg, build_run(cfg, CPU, log=lambda *a: None)


def token_mean_loss(model, batches) -> torch.Tensor:
    """The mean cross-entropy over every real target token of ``batches`` taken together (one
    concatenated batch), padding (id 0) left out, from the model's logits."""
    total, count = 0.0, 0
    for b in batches:
        logits = model(b.src, b.tgt_in, src_mask=b.src_mask, tgt_mask=b.tgt_mask)
        total = total + F.cross_entropy(logits.flatten(0, 1).float(), b.tgt_out.flatten(), reduction="sum",
                                        ignore_index=0)
        count += int((b.tgt_out != 0).sum())
    return total / count


def step_grads(model, fwd_model, objective, batches, tc, par=None) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    recorder = GradRecorder(params)
    train_step(fwd_model, objective, batches, recorder, grad_scaler("fp32", CPU), params, tc, CPU, runtime=par)
    return recorder.grads


def assert_same_grads(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """fp32, a few hundred tokens summed in another order: each tensor within 1e-5 of its norm."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert torch.linalg.norm(g - r) <= 1e-5 * torch.linalg.norm(r) + 1e-9, float(torch.linalg.norm(g - r))


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_a_training_step_takes_the_gradient_of_the_token_mean_loss(grad_accum):
    """The gradient ``train_step`` hands the optimizer, with ``grad_accum`` micro-batches that
    hold different numbers of real tokens, is that of the mean token loss over all of them
    together: not a mean of per-micro-batch means, not a sum, padding not counted."""
    cfg, run = copy_run(f"train.grad_accum={grad_accum}")
    model, objective = run.model, run.objective
    batches = [objective.next_batch() for _ in range(grad_accum)]
    if grad_accum > 1:
        assert len({b.num_tokens for b in batches}) > 1  # unequal shares: a plain mean would differ
    assert all(bool((b.tgt_out == 0).any()) for b in batches)  # padding present
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    ref = torch.autograd.grad(token_mean_loss(model, batches), params, allow_unused=True)
    ref = [torch.zeros_like(p) if r is None else r for p, r in zip(params, ref)]
    assert_same_grads(step_grads(model, model, objective, batches, cfg.train), ref)


def _parallel_grads(rank: int, layout: str, tmp: str) -> None:
    """On each of 2 ranks: the global batch's gradient under DDP or FSDP equals the one-process
    gradient of its token mean loss (computed here, before the model is wrapped)."""
    from blockformer import parallel  # noqa: PLC0415

    cfg, run = copy_run("train.grad_accum=2", layout)
    model, objective = run.model, run.objective
    batches = [objective.next_batch() for _ in range(2)]
    model.train()
    reference = copy.deepcopy(model)
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    ref = torch.autograd.grad(token_mean_loss(reference, batches), ref_params, allow_unused=True)
    ref = [torch.zeros_like(p) if r is None else r for p, r in zip(ref_params, ref)]
    par = parallel.start(cfg, CPU)  # joins the helper's process group
    wrapped, fwd_model = parallel.parallelize(model, cfg, par, cfg.train)
    assert_same_grads(step_grads(wrapped, fwd_model, objective, batches, cfg.train, par), ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.dp_replicate=2", "parallel.dp_shard=2"], ids=["ddp", "fsdp"])
def test_ddp_and_fsdp_steps_take_the_gradient_of_the_global_token_mean(tmp_path, layout):
    run_ranks(2, _parallel_grads, layout, str(tmp_path))


# ---------------------------------------------------------------------- 3. MoE auxiliary losses
def moe_lm(tmp_path: Path, *overrides: str):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(100)))
    cfg = load_run_config(overrides=[
        *TINY, "model.n_layers=2", "model.ffn_experts=4", "model.experts_top_k=2", f"data.text={corpus}",
        "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16",
        "model.max_seq_len=16",
        "train.batch_size=4", *overrides])
    torch.manual_seed(0)
    return cfg, build_run(cfg, CPU, log=lambda *a: None)


def hand_aux_loss(router_inputs: list[torch.Tensor], layers: list[MoEFeedForward], aux: float, z: float):
    """Switch's balance loss ``E sum_e f_e P_e`` and ST-MoE's z-loss ``mean(logsumexp^2)``,
    weighted, averaged over the MoE layers, from each layer's router input (no padding)."""
    total = 0.0
    for x, layer in zip(router_inputs, layers):
        logits = x.reshape(-1, x.shape[-1]).float() @ layer.router.float().t()  # (N, E)
        E = logits.shape[-1]
        chosen = F.one_hot(logits.topk(layer.top_k, dim=-1).indices, E).sum(1).float()
        balance = E * (chosen.mean(0) * logits.softmax(-1).mean(0)).sum()
        total = total + aux * balance + z * (torch.logsumexp(logits, -1) ** 2).mean()
    return total / len(layers)


def test_the_moe_auxiliary_losses_reach_the_routers_gradient(tmp_path):
    """A training step with aux coefficients (0.5, 0.1) against (0, 0), on the same batches:
    the gradients differ by exactly the gradient of the weighted auxiliary loss, which
    reaches the routers (and, through their inputs, the layers below)."""
    cfg, run = moe_lm(tmp_path, "train.grad_accum=2")
    model, objective = run.model, run.objective
    batches = [objective.next_batch() for _ in range(2)]
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    params = [p for p in model.parameters() if p.requires_grad]

    def grads_with(aux: float, z: float) -> list[torch.Tensor]:
        for m in layers:
            m.aux_coef, m.z_coef = aux, z
        return step_grads(model, model, objective, batches, cfg.train)

    without, with_aux = grads_with(0.0, 0.0), grads_with(0.5, 0.1)
    model.train()
    inputs: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for m in layers]
    aux_grad = [torch.zeros_like(p) for p in params]
    n = sum(objective.count_targets(b) for b in batches)
    try:
        for b in batches:  # each micro-batch's auxiliary loss weighted by its share of the tokens
            inputs.clear()
            model(b[0])
            share = hand_aux_loss(inputs, layers, 0.5, 0.1) * (b[1].numel() / n)
            for acc, g in zip(aux_grad, torch.autograd.grad(share, params, allow_unused=True)):
                if g is not None:
                    acc += g
    finally:
        for h in hooks:
            h.remove()
    routers = [i for i, p in enumerate(params) if any(p is m.router for m in layers)]
    assert len(routers) == 2 and all(aux_grad[i].norm() > 1e-3 for i in routers)  # the term is not negligible
    for i, (a, b, g) in enumerate(zip(with_aux, without, aux_grad)):
        torch.testing.assert_close(a - b, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"parameter {i}: {m}")
