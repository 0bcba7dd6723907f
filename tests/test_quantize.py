"""Int8 weight-only quantization for decoding: error bounds, and the same greedy tokens."""

import pytest
import torch
from torch import nn

from blockformer import TransformerConfig, build_model
from blockformer.generate import generate
from blockformer.generate.quantize import Int8Linear, quantize_int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_error_is_within_half_a_step_per_weight(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() == 127
    x = torch.randn(5, 64)
    exact = linear(x)
    # Each weight is off by at most half a quantization step, scales[n] / 2.
    bound = x.abs().sum(-1, keepdim=True) * q.scales.float()[None] / 2
    assert ((q(x) - exact).abs() <= bound + 1e-5).all()
    assert (q(x) - exact).abs().max() > 0  # it really is quantized
    out = q(x.to(dtype)).float()
    assert ((out - exact).abs() <= bound + 0.05 * exact.abs() + 0.05).all()


def test_quantized_decoder_reads_int8_weights_and_keeps_every_clear_greedy_choice():
    cfg = TransformerConfig(arch="decoder", vocab_size=50, d_model=64, n_layers=2, n_heads=4, init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))
    float_logits = model(tokens)
    quantize_int8(model)
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, out, up, down per block, and the head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.embed.tokens.weight.dtype == torch.float32  # embeddings stay float
    q_logits = model(tokens)
    error = (q_logits - float_logits).abs().max()
    relative_rms = (q_logits - float_logits).pow(2).mean().sqrt() / float_logits.pow(2).mean().sqrt()
    assert error > 0 and relative_rms < 0.03
    # Wherever the float model's top choice leads by more than twice the largest logit
    # error, the int8 model makes the same choice; that is most positions here.
    top2 = float_logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * error
    assert clear.float().mean() > 0.5
    assert torch.equal(q_logits.argmax(-1)[clear], float_logits.argmax(-1)[clear])
    # And it decodes through the KV cache like any model.
    assert len(generate(model, [[5, 9, 2, 7]], 12, temperature=0)[0]) == 12
