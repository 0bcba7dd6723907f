"""Dropout with the cheap CPU mask: the right rate, exact expectation, reproducible masks,
and attention dropout equal to softmax-then-mask computed by hand."""

import pytest
import torch
import torch.nn.functional as F

from blockformer.nn.attention import sdpa
from blockformer.nn.dropout import Dropout, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_drop_rate_and_expectation(p):
    torch.manual_seed(0)
    y = dropout(torch.ones(1000, 1000), p)
    dropped = (y == 0).float()
    assert abs(dropped.mean().item() - p) < 3e-3
    assert abs(y.mean().item() - 1.0) < 5e-3  # kept values are scaled by the exact keep rate
    kept = y[y != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1.0 / (1.0 - round(p * 65536) / 65536)))
    # every 16-bit slice of a 64-bit random word is uniform: the rate holds in each lane
    lanes = dropped.view(-1, 4).mean(0)
    assert (lanes - p).abs().max().item() < 5e-3, lanes


def test_masks_are_reproducible_and_fresh():
    torch.manual_seed(3)
    a, _ = keep_mask((64, 64), 0.3)
    b, _ = keep_mask((64, 64), 0.3)
    torch.manual_seed(3)
    a2, _ = keep_mask((64, 64), 0.3)
    assert torch.equal(a, a2)
    assert (a != b).float().mean().item() > 0.3  # independent draws differ in ~42% of places


def test_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(1)
    x = torch.randn(37, 53, dtype=torch.bfloat16, requires_grad=True)  # an odd size: the mask is cut short
    y = dropout(x, 0.25)
    g = torch.randn_like(y)
    y.backward(g)
    keep = y != 0
    assert torch.equal(x.grad, (g * keep * (1 / 0.75)).to(x.grad.dtype))
    assert torch.equal(y[keep], (x[keep] * (1 / 0.75)).to(y.dtype))


def test_module_is_identity_in_eval_and_at_p0():
    x = torch.randn(8, 8)
    m = Dropout(0.5).eval()
    assert m(x) is x and dropout(x, 0.0) is x
    assert repr(m) == "Dropout(p=0.5, inplace=False)"


@pytest.mark.parametrize("masked", [False, True])
def test_attention_dropout_drops_weights_after_the_softmax(masked):
    """Attention dropout on a CPU: softmax(q k^T / sqrt(d) + mask), then the weights are
    masked and rescaled, then multiplied by v; checked against the same mask applied by hand."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril() if masked else None
    torch.manual_seed(7)
    out = sdpa(q, k, v, mask, not masked, 0.2)
    torch.manual_seed(7)
    keep, rate = keep_mask((2, 4, 10, 10), 0.2)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    weights = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
    reference = (weights * keep / rate) @ v
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(sdpa(q, k, v, mask, not masked, 0.0), F.scaled_dot_product_attention(
        q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)
