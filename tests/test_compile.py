"""The decoder compiles with torch.compile without graph breaks (fullgraph=True)."""

import pytest
import torch

from blockformer import TransformerConfig, build_model


def decoder(**kw):
    cfg = TransformerConfig(arch="decoder", vocab_size=100, d_model=64, n_layers=2, n_heads=4, **kw)
    return build_model(cfg, seed=0)


@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_decoder_forward_and_cached_step_trace_as_one_graph(position):
    torch._dynamo.reset()
    model = decoder(position=position).eval()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # raises on any graph break
    tokens = torch.randint(0, 100, (2, 12))
    torch.testing.assert_close(compiled(tokens), model(tokens))
    cache = model.new_cache(2, 16)
    compiled(tokens, cache=cache, cache_pos=torch.arange(12))
    step = compiled(tokens[:, :1], cache=cache, cache_pos=torch.tensor([12]))
    assert step.shape == (2, 1, 100)


@pytest.mark.slow
def test_inductor_compiled_decoder_matches_eager_forward_and_gradients():
    torch._dynamo.reset()
    model = decoder()
    tokens = torch.randint(0, 100, (2, 16))
    eager = model(tokens)
    eager.square().mean().backward()
    grad = model.decoder.blocks[0].attn.qkv.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(tokens)
    out.square().mean().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.decoder.blocks[0].attn.qkv.weight.grad, grad, atol=1e-5, rtol=1e-4)
