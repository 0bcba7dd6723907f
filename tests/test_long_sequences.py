"""Causal training at long T takes the fused attention kernel: no T x T tensor is ever
built (no mask, no score matrix), forward or backward."""

import pytest
import torch
import torch.nn.functional as F

from blockformer import TransformerConfig, build_model
from blockformer.probes.memory import TensorMemory

T = 2048


def _train_step(model, tokens, **kw):
    logits = model(tokens, **kw)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)).backward()


class Ops(TensorMemory):
    """TensorMemory that also records the attention ops called."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.__name__ or "softmax" in func.__name__:
            self.attention_ops.add(func.__name__.split(".")[0])
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_causal_training_at_long_length_builds_no_t_by_t_tensor(position):
    cfg = TransformerConfig(arch="decoder", vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                            max_seq_len=T, position=position, dropout=0.0)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (1, T))
    with Ops() as fused:
        _train_step(model, tokens)
    assert fused.largest < T * T  # not even a bool T x T mask (4 MiB here)
    assert "_softmax" not in fused.attention_ops  # the math path's score softmax
    assert any("flash" in op or "efficient" in op or "cudnn" in op for op in fused.attention_ops), fused.attention_ops
    # The same step with an all-true padding mask must materialise the mask: the check can fail.
    model.zero_grad()
    with Ops() as masked:
        _train_step(model, tokens, attention_mask=torch.ones(1, T, dtype=torch.bool))
    assert masked.largest >= T * T
    assert masked.peak > fused.peak


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype,keys,grad,fused", [
    (torch.bfloat16, 64, True, False),  # training in bf16 over short keys: the unfused kernel
    (torch.bfloat16, 256, True, True),  # longer keys: the fused one (measured faster from ~256)
    (torch.float32, 64, True, True),  # fp32: fused at every length
    (torch.bfloat16, 64, False, True),  # inference: fused
])
def test_cpu_attention_kernel_follows_the_measured_choice(monkeypatch, dtype, keys, grad, fused):
    """On the CPU kind it was measured on (AVX512-BF16, no AMX); elsewhere torch's fused choice."""
    from blockformer import kernels  # noqa: PLC0415
    from blockformer.nn.attention import sdpa  # noqa: PLC0415

    monkeypatch.setattr(kernels, "UNFUSED_SHORT_BF16", True)
    q, k, v = (torch.randn(2, 4, keys, 16, dtype=dtype, requires_grad=grad) for _ in range(3))
    with _Ops() as ops, torch.set_grad_enabled(grad):
        out = sdpa(q, k, v, None, True, 0.0)
    assert any("flash_attention" in n for n in ops.names) is fused, sorted(ops.names)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - reference).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    monkeypatch.setattr(kernels, "UNFUSED_SHORT_BF16", False)  # an unmeasured CPU kind
    with _Ops() as ops, torch.set_grad_enabled(grad):
        sdpa(q, k, v, None, True, 0.0)
    assert any("flash_attention" in n for n in ops.names)


@pytest.mark.parametrize("keys", [24, 256])
def test_masked_bf16_training_attention_equals_the_reference(monkeypatch, keys):
    """A padding + causal boolean mask (as sequence-to-sequence batches build it) hides the
    same keys on the unfused path as on torch's own: forward and gradients within bf16."""
    from blockformer import kernels  # noqa: PLC0415
    from blockformer.nn.attention import sdpa  # noqa: PLC0415

    monkeypatch.setattr(kernels, "UNFUSED_SHORT_BF16", True)

    torch.manual_seed(0)
    lengths = torch.tensor([keys, keys - 5, 3])
    real = torch.arange(keys)[None, :] < lengths[:, None]  # (B, S) padding
    causal = torch.ones(keys, keys, dtype=torch.bool).tril()
    mask = (real[:, None, None, :] & causal[None, None]) | ~real[:, None, :, None]  # padded queries see all
    q, k, v = (torch.randn(3, 4, keys, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = sdpa(q, k, v, mask, False, 0.0)
    (out.float() * real[:, None, :, None]).square().sum().backward()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    (ref * real[:, None, :, None]).square().sum().backward()
    assert (out.float() - ref).abs().max().item() < 3e-2
    for a, b in ((q, q32), (k, k32), (v, v32)):
        assert (a.grad.float() - b.grad).abs().max().item() < 0.15 * b.grad.abs().max().item()
    leaked = sdpa(q, k, v, torch.ones_like(mask), False, 0.0)  # the mask must matter
    assert ((leaked.float() - ref) * real[:, None, :, None]).abs().max().item() > 0.1
