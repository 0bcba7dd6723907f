"""The head fused with the loss (``nn/loss.py`` ``head_loss``, ``model(..., targets=)``) gives
the loss and gradients of ``token_loss(head(h))``, without the whole logits."""

import pytest
import torch
from torch import nn

from blockformer import TransformerConfig, build_model, kernels
from blockformer.nn import loss as loss_module
from blockformer.kernels import HEAD_LOSS_CHUNK_ROWS as CHUNK_ROWS
from blockformer.nn.loss import head_loss, token_loss
from blockformer.probes.memory import TensorMemory

from numerics import assert_close_sums


@pytest.fixture(autouse=True)
def fuse_every_vocabulary(monkeypatch):
    """Small heads keep these tests fast; the fused path is taken whatever the vocabulary."""
    monkeypatch.setattr(kernels, "FUSE_MIN_VOCAB", 0)


def _head_and_batch(n: int, d: int = 16, vocab: int = 50, bias: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    head = nn.Linear(d, vocab, bias=bias)
    h = torch.randn(2, n, d)
    targets = torch.randint(1, vocab, (2, n))
    targets[0, -3:] = 0  # padding
    targets[1, ::4] = 0
    return head, h, targets


def _loss_and_grads(fn, head, h, targets, eps):
    head.zero_grad(set_to_none=True)
    x = h.clone().requires_grad_()
    loss = fn(x, head, targets, eps)
    (loss / 7.0).backward()  # a scale other than 1 reaches every gradient
    grads = [x.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
    return loss.detach(), grads


def _unfused(h, head, targets, eps):
    return token_loss(head(h), targets, eps)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_loss_and_gradients_equal_the_unfused_ones_in_fp32(eps, bias):
    head, h, targets = _head_and_batch(n=CHUNK_ROWS + 37, bias=bias)  # rows over two chunks, the last partial
    want, want_grads = _loss_and_grads(_unfused, head, h, targets, eps)
    got, got_grads = _loss_and_grads(head_loss, head, h, targets, eps)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_fused_loss_under_bf16_autocast_matches_the_unfused_one():
    head, h, targets = _head_and_batch(n=300, d=32, vocab=500)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _loss_and_grads(_unfused, head, h, targets, 0.1)
        got, got_grads = _loss_and_grads(head_loss, head, h, targets, 0.1)
    assert got.dtype == torch.float32
    # the same bf16 logits, scored in float32: equal up to the order of the sums
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)  # bf16 products either way


def test_fused_loss_without_gradients_is_the_same_number():
    head, h, targets = _head_and_batch(n=70)
    with torch.no_grad():
        assert float(head_loss(h, head, targets, 0.1)) == pytest.approx(float(_unfused(h, head, targets, 0.1)), rel=1e-6)


def test_all_padding_costs_nothing_and_moves_nothing():
    head, h, _ = _head_and_batch(n=10)
    loss, grads = _loss_and_grads(head_loss, head, h, torch.zeros(2, 10, dtype=torch.long), 0.1)
    assert float(loss) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_the_whole_float32_logits_are_never_made():
    """At 512 tokens x 8000 classes the unfused loss keeps float32 logits and log-probs
    (16 MB each; 51 MB at its peak); the fused one holds their gradient and a few chunks
    (31 MB)."""
    head, h, targets = _head_and_batch(n=256, d=64, vocab=8000)
    peaks = {}
    for name, fn in (("unfused", _unfused), ("fused", head_loss)):
        x = h.clone().requires_grad_()
        with TensorMemory() as mem:
            fn(x, head, targets, 0.1).backward()
        peaks[name] = mem.peak
    logits_bytes = 512 * 8000 * 4
    assert peaks["unfused"] >= 2 * logits_bytes
    assert peaks["fused"] <= logits_bytes + 4 * CHUNK_ROWS * 8000 * 4 + 2 * 8000 * 64 * 4
    assert peaks["unfused"] - peaks["fused"] >= logits_bytes  # at least one whole float32 copy fewer


def test_a_small_vocabulary_is_scored_in_one_piece(monkeypatch):
    monkeypatch.setattr(kernels, "FUSE_MIN_VOCAB", 1000)
    called = []
    monkeypatch.setattr(loss_module._LinearCrossEntropy, "apply", lambda *a: called.append(a))
    head, h, targets = _head_and_batch(n=20, vocab=999)
    with torch.no_grad():
        assert float(head_loss(h, head, targets)) == pytest.approx(float(_unfused(h, head, targets, 0.0)))
    assert not called
    head, h, targets = _head_and_batch(n=20, vocab=1000)
    head_loss(h, head, targets)
    assert len(called) == 1


def test_a_subclassed_head_is_scored_through_its_own_forward(monkeypatch):
    class Shifted(nn.Linear):  # as LoRA does: the product is not weight @ h alone
        def forward(self, x):
            return super().forward(x) + 1.0 * (torch.arange(self.out_features) == 3)

    torch.manual_seed(0)
    head = Shifted(8, 10)
    h, targets = torch.randn(1, 5, 8), torch.tensor([[3, 1, 2, 3, 0]])
    called = []
    monkeypatch.setattr(loss_module._LinearCrossEntropy, "apply", lambda *a: called.append(a))
    with torch.no_grad():
        assert float(head_loss(h, head, targets)) == pytest.approx(float(token_loss(head(h), targets)))
    assert not called


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_a_model_given_targets_returns_the_loss_of_its_logits(arch):
    cfg = TransformerConfig(arch=arch, vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                            max_seq_len=32, head_bias=arch == "encoder")
    model = build_model(cfg, seed=0).train()
    torch.manual_seed(1)
    tokens = torch.randint(1, 300, (3, 20))
    targets = torch.randint(0, 300, (3, 20))
    args = (tokens, tokens[:, :12]) if arch == "encoder-decoder" else (tokens,)
    if arch == "encoder-decoder":
        targets = targets[:, :12]

    def run(fused: bool):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2)  # the same dropout masks in both runs
        loss = model(*args, targets=targets, label_smoothing=0.1) if fused else token_loss(model(*args), targets, 0.1)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run(False)
    got, got_grads = run(True)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, g in got_grads.items():  # every gradient sums over the batch's tokens
        assert_close_sums(g, want_grads[name], terms=targets.numel(), msg=name)
