"""csrc/causal_attention.c: causal self-attention for fp32 training, forward and backward, equals
attention computed in fp64 on every build (this CPU's, AVX2's, plain C), and training on a CPU
takes it where ``kernels.causal_training_kernel`` says so, learning as it does through SDPA."""

import pytest
import torch
import torch.nn.functional as F

from blockformer import TransformerConfig, build_model, kernels
from blockformer.nn import attention as ATTENTION
from blockformer.nn import causal_attention as CAUSAL
from native_builds import kernels_built_for

# B, H, T, D: nanoGPT's shape, one token, odd lengths, widths in blocks of 32 and 8 (40), and not of 8 (12)
SHAPES = [(6, 4, 64, 32), (1, 2, 1, 32), (2, 3, 5, 8), (2, 2, 100, 64), (1, 1, 17, 12), (2, 2, 9, 40),
          (1, 1, 256, 16)]


def qkv_views(x: torch.Tensor, H: int, D: int):
    """q, k, v (B, H, T, D) as views of one fused projection (B, T, 3 H D), as the model makes them."""
    B, T, _ = x.shape
    return [t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=-1)]


def reference(q, k, v, scale):
    """The causal softmax(scale q k^T) v written out."""
    T = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("cap", [None, "avx2", "default"])  # this CPU's build, AVX2's, plain C
def test_the_kernel_equals_fp64_attention_outputs_and_gradients(cap, monkeypatch):
    with kernels_built_for(cap, monkeypatch, CAUSAL.kernels):
        assert CAUSAL.kernels() is not None
        g = torch.Generator().manual_seed(0)
        for B, H, T, D in SHAPES:
            scale = 0.7 / D ** 0.5
            x = (torch.randn(B, T, 3 * H * D, generator=g, dtype=torch.float64) * 2).requires_grad_()
            want = reference(*qkv_views(x, H, D), scale)
            grad_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
            want_grad, = torch.autograd.grad(want, x, grad_out)
            x32 = x.detach().float().requires_grad_()
            got = CAUSAL.causal_attention(*qkv_views(x32, H, D), scale)
            got_grad, = torch.autograd.grad(got, x32, grad_out.float())
            assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()  # (B, T, H, D) underneath
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5, msg=f"{(B, H, T, D)} outputs")
            torch.testing.assert_close(got_grad.double(), want_grad, rtol=0, atol=5e-5, msg=f"{(B, H, T, D)} grads")


@pytest.mark.parametrize("cap", [None, "default"])
def test_contiguous_inputs_a_transposed_output_gradient_and_two_threads_give_the_same(cap, monkeypatch):
    """The strides of every tensor are read, not assumed: separate contiguous q, k, v, and an output
    gradient laid out (B, H, T, D), give what the fused views give; two threads split the pairs."""
    with kernels_built_for(cap, monkeypatch, CAUSAL.kernels):
        g = torch.Generator().manual_seed(1)
        B, H, T, D = 3, 4, 33, 32
        q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
        grad_out = torch.randn(B, H, T, D, generator=g)  # contiguous (B, H, T, D): not the layout of the output
        want = reference(q.double(), k.double(), v.double(), 0.2)
        want_grads = torch.autograd.grad(want, (q, k, v), grad_out.double())
        threads = torch.get_num_threads()
        for n in (1, 2):
            torch.set_num_threads(n)
            try:
                got = CAUSAL.causal_attention(q, k, v, 0.2)
                got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
            finally:
                torch.set_num_threads(threads)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
            for a, b in zip(got_grads, want_grads):
                torch.testing.assert_close(a, b, rtol=0, atol=5e-5)


def test_a_nan_spreads_as_it_does_through_sdpa_and_huge_scores_weigh_like_sdpas():
    q, k, v = (torch.randn(2, 2, 20, 32) for _ in range(3))
    q[0, 1, 7, 3] = float("nan")  # row 7 of that pair: every score NaN
    k[1, 0, 4, 0] = float("nan")  # key 4: the scores of rows 4 on
    got = CAUSAL.causal_attention(q, k, v, 32 ** -0.5)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.isnan().any() and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=2e-5)
    big = CAUSAL.causal_attention(q.nan_to_num(), k.nan_to_num(), v, 40.0)  # scores of +-1000: one key per row wins
    ref = F.scaled_dot_product_attention(q.nan_to_num(), k.nan_to_num(), v, is_causal=True, scale=40.0)
    assert big.isfinite().all()
    torch.testing.assert_close(big, ref, rtol=0, atol=1e-4)  # scores of 1000 carry rounding of 1e-4 in fp32


def test_bad_inputs_are_refused_with_what_was_expected():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="q, k, v: expected fp32 of one shape"):
        CAUSAL.causal_attention(q, q[:, :, :4], q, 1.0)
    with pytest.raises(ValueError, match="q, k, v: expected fp32"):
        CAUSAL.causal_attention(q, q.double(), q, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.randn(1, 2, 16, 8).transpose(2, 3)
        CAUSAL.causal_attention(t, t, t, 1.0)


def test_the_choice_is_fp32_causal_training_with_as_many_key_heads_up_to_the_limit():
    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    k = torch.randn(2, 4, 64, 32)
    assert kernels.causal_training_kernel(q, k, k, None, True, 0.0)
    assert not kernels.causal_training_kernel(q, k, k, None, False, 0.0)  # not causal
    assert not kernels.causal_training_kernel(q, k, k, torch.ones(64, 64, dtype=torch.bool), True, 0.0)
    assert not kernels.causal_training_kernel(q, k, k, None, True, 0.1)  # dropout
    assert not kernels.causal_training_kernel(q.bfloat16(), k.bfloat16(), k.bfloat16(), None, True, 0.0)
    assert not kernels.causal_training_kernel(q, k[:, :2], k[:, :2], None, True, 0.0)  # GQA
    assert not kernels.causal_training_kernel(q, k[:, :, :9], k[:, :, :9], None, True, 0.0)  # keys past the queries
    assert not kernels.causal_training_kernel(q.detach(), k, k, None, True, 0.0)  # nothing to differentiate
    with torch.no_grad():
        assert not kernels.causal_training_kernel(q, k, k, None, True, 0.0)
    n = kernels.CAUSAL_KERNEL_MAX_TOKENS
    long_q = torch.randn(1, 1, n + 1, 8, requires_grad=True)
    assert not kernels.causal_training_kernel(long_q, long_q, long_q, None, True, 0.0)
    assert kernels.causal_training_kernel(long_q[:, :, :n], long_q[:, :, :n], long_q[:, :, :n], None, True, 0.0)
    t = torch.randn(1, 1, 32, 8, requires_grad=True).transpose(2, 3)
    assert not kernels.causal_training_kernel(t, t, t, None, True, 0.0)  # values not contiguous


def test_under_a_dispatch_mode_torchs_own_ops_run():
    """A dispatch mode watching torch's ops (the cost probe's FLOP counter, the memory probe) sees attention
    and GELU as torch's ops, not a kernel it cannot look into: both kernels step aside under one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    assert kernels.causal_training_kernel(q, k, v, None, True, 0.0) and kernels.gelu_kernel(q)
    with Names() as watched:
        assert not kernels.causal_training_kernel(q, k, v, None, True, 0.0) and not kernels.gelu_kernel(q)
        ATTENTION.sdpa(q, k, v, None, True, 0.0)
    assert any("flash_attention" in name for name in watched.names), sorted(watched.names)


def test_training_takes_the_kernel_and_learns_as_through_sdpa(monkeypatch):
    """The same decoder, data and AdamW steps, once through the kernel and once through SDPA: every
    layer's attention took the kernel, and the losses agree to fp32 rounding over the steps."""
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=2, n_heads=4, max_seq_len=32,
                            dropout=0.0)
    calls = []
    real = ATTENTION.causal_attention
    monkeypatch.setattr(ATTENTION, "causal_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    data = torch.randint(0, 50, (4, 33), generator=torch.Generator().manual_seed(2)).expand(6, -1, -1)  # one batch, learnt

    def losses(kernel: bool) -> list[float]:
        monkeypatch.setattr(kernels, "CAUSAL_TRAINING_KERNEL", kernel)
        model = build_model(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        out = []
        for batch in data:
            logits = model(batch[:, :-1])
            logits = logits if torch.is_tensor(logits) else logits.logits
            loss = F.cross_entropy(logits.reshape(-1, 50), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    through_sdpa = losses(False)
    assert calls == []
    through_kernel = losses(True)
    assert calls == [(4, 4, 32, 16)] * 2 * 6  # two layers, six steps
    assert through_kernel[-1] < through_kernel[0] - 0.1  # it learns
    torch.testing.assert_close(through_kernel, through_sdpa, rtol=0, atol=1e-4)
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        model(data[0, :, :-1])
    assert len(calls) == 12  # inference keeps SDPA
