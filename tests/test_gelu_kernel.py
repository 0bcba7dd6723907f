"""csrc/gelu.c: GELU, exact and in its tanh form, and the derivative it keeps for the backward equal
GELU in fp64 on every build (this CPU's, AVX2's, plain C), and a feed-forward network takes it in fp32
training only."""

import pytest
import torch
import torch.nn.functional as F

from blockformer import TransformerConfig, kernels
from blockformer.nn import gelu as GELU
from blockformer.nn.feedforward import FeedForward
from native_builds import kernels_built_for


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("cap", [None, "avx2", "default"])  # this CPU's build, AVX2's, plain C
def test_the_kernel_equals_fp64_gelu_and_its_gradient(cap, approximate, monkeypatch):
    """Sizes with a tail past the last block of 8, and one split over two threads; values from -30 to
    30 and the edges: zeros of both signs, tiny ones, where erf (or tanh) saturates."""
    with kernels_built_for(cap, monkeypatch, GELU.kernel):
        assert GELU.kernel(approximate) is not None
        g = torch.Generator().manual_seed(0)
        threads = torch.get_num_threads()
        for n, t in [(1, 1), (13, 1), (4096, 1), (200_003, 2)]:
            x = torch.randn(n, generator=g, dtype=torch.float64) * 4
            x[: min(n, 8)] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 6.0, -6.0], dtype=torch.float64)[:n]
            x.requires_grad_()
            want = F.gelu(x, approximate=approximate)
            grad_out = torch.randn(n, generator=g, dtype=torch.float64)
            want_grad, = torch.autograd.grad(want, x, grad_out)
            x32 = x.detach().float().requires_grad_()
            torch.set_num_threads(t)
            try:
                got = GELU.GeluKeepingDerivative.apply(x32, approximate)
            finally:
                torch.set_num_threads(threads)
            got_grad, = torch.autograd.grad(got, x32, grad_out.float())
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=2e-6, msg=f"GELU, {n}")
            torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-6, atol=2e-6, msg=f"its gradient, {n}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("cap", [None, "default"])
def test_nan_stays_nan_and_infinity_is_infinity(cap, approximate, monkeypatch):
    """NaN in, NaN out, value and gradient; GELU(+inf) is +inf (torch's vectorised GELU gives NaN there)."""
    with kernels_built_for(cap, monkeypatch, GELU.kernel):
        x = torch.tensor([float("nan"), float("inf"), 1.0, 2.0, -1.0, 0.5, 3.0, -2.0, float("nan")], requires_grad=True)
        y = GELU.GeluKeepingDerivative.apply(x, approximate)
        assert y.isnan().tolist() == [True] + [False] * 7 + [True] and y[1] == float("inf")
        torch.testing.assert_close(y[2:8], F.gelu(x.detach()[2:8], approximate=approximate))
        grad, = torch.autograd.grad(y.sum(), x)
        assert grad[0].isnan() and grad[8].isnan() and grad[2:8].isfinite().all()


def test_the_choice_is_fp32_with_a_gradient_on_the_cpu():
    x = torch.randn(4, 8, requires_grad=True)
    assert kernels.gelu_kernel(x)
    assert not kernels.gelu_kernel(x.detach())
    assert not kernels.gelu_kernel(x.bfloat16())
    assert not kernels.gelu_kernel(x.double())
    with torch.no_grad():
        assert not kernels.gelu_kernel(x)


@pytest.mark.parametrize("ffn,approximate", [("gelu", "none"), ("geglu", "none"), ("gelu", "tanh")])
def test_a_feed_forward_network_trains_through_it_as_through_torchs_gelu(ffn, approximate, monkeypatch):
    cfg = TransformerConfig(arch="decoder", vocab_size=10, d_model=16, n_layers=1, n_heads=2, ffn=ffn,
                            gelu_approximate=approximate)
    calls = []
    real = GELU.GeluKeepingDerivative.apply
    monkeypatch.setattr(GELU.GeluKeepingDerivative, "apply", lambda x, form: calls.append(form) or real(x, form))
    torch.manual_seed(0)
    ffn_net = FeedForward(cfg)
    x = torch.randn(3, 5, 16, requires_grad=True)

    def run(kernel: bool):
        monkeypatch.setattr(kernels, "GELU_KERNEL", kernel)
        ffn_net.zero_grad()
        x.grad = None
        out = ffn_net(x)
        out.pow(2).sum().backward()
        return out.detach(), x.grad.clone(), ffn_net.up.weight.grad.clone()

    through_torch = run(False)
    assert calls == []
    through_kernel = run(True)
    assert calls == [approximate]
    for a, b in zip(through_kernel, through_torch):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ffn_net(x)
    assert len(calls) == 1  # inference keeps torch's
