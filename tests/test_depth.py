"""Residual connections carry the gradient through depth (at initialisation, 32 blocks)."""

import pytest
import torch

from blockformer import TransformerConfig, build_model


def first_and_last_block_grad_norms(**kw) -> tuple[float, float]:
    cfg = TransformerConfig(arch="decoder", vocab_size=64, d_model=32, n_layers=32, n_heads=4, max_seq_len=16, **kw)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()

    def norm(block):
        return torch.cat([p.grad.flatten() for p in block.parameters()]).norm().item()

    blocks = model.decoder.blocks
    return norm(blocks[0]), norm(blocks[-1])


# Post-Norm as in the paper: embeddings scaled by sqrt(d_model) so the first block's input has
# unit scale. (With tiny unscaled embeddings the first LayerNorm divides by their 0.02 RMS and
# the first block's gradient is 50x inflated; that is the embedding's doing, not depth's.)
@pytest.mark.parametrize(
    "variant",
    [dict(norm_position="pre"), dict(norm_position="post", position="sinusoidal", scale_embeddings=True)],
    ids=["pre-norm", "post-norm"],
)
def test_residual_stack_keeps_first_block_gradient_within_10x_of_last(variant):
    first, last = first_and_last_block_grad_norms(**variant)
    assert 0.1 < first / last < 10


def test_without_residual_or_norm_the_first_block_gets_1000x_less_gradient():
    first, last = first_and_last_block_grad_norms(residual="none", norm="none")
    assert last > 0 and first < last / 1000  # at 32 blocks it underflows to exactly 0
