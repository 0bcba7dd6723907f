"""The block itself: the seed's worked example, Pre- vs Post-Norm, parity with PyTorch."""

import pytest
import torch
from torch import nn

from blockformer import Block, TransformerConfig
from blockformer.nn import AttnInputs


class Fixed(nn.Module):
    """A sublayer that ignores its input (but records it) and returns a fixed vector."""

    def __init__(self, value):
        super().__init__()
        self.value = torch.tensor(value)
        self.seen = []

    def forward(self, h, *args):
        self.seen.append(h.detach().clone())
        return self.value.expand_as(h)


def toy_block(norm_position: str) -> Block:
    cfg = TransformerConfig(d_model=2, n_heads=1, norm="layer", norm_eps=1e-12, norm_position=norm_position)
    block = Block(cfg).eval()
    block.attn, block.ffn = Fixed([0.4, -0.2]), Fixed([0.3, 0.5])
    return block


def test_worked_example_pre_norm():
    block = toy_block("pre")
    x = torch.tensor([[[1.0, 2.0]]])
    y = block(x)
    torch.testing.assert_close(block.attn.seen[0], torch.tensor([[[-1.0, 1.0]]]))  # Norm(x)
    torch.testing.assert_close(block.ffn.seen[0], torch.tensor([[[-1.0, 1.0]]]))  # Norm(r), r = [1.4, 1.8]
    torch.testing.assert_close(y, torch.tensor([[[1.7, 2.3]]]))  # y = r + F


def test_worked_example_post_norm():
    block = toy_block("post")
    x = torch.tensor([[[1.0, 2.0]]])
    y = block(x)
    # The sublayer sees the raw input; the norm comes after each sum.
    torch.testing.assert_close(block.attn.seen[0], x)
    # r' = Norm(x + A) = Norm([1.4, 1.8]) = [-1, 1]; the FFN reads r'.
    torch.testing.assert_close(block.ffn.seen[0], torch.tensor([[[-1.0, 1.0]]]))
    # y = Norm(r' + F) = Norm([-0.7, 1.5]): mean 0.4, deviation 1.1 -> [-1, 1].
    torch.testing.assert_close(y, torch.tensor([[[-1.0, 1.0]]]))


def test_post_norm_hand_arithmetic_in_three_dimensions():
    cfg = TransformerConfig(d_model=3, n_heads=1, norm_eps=1e-12, norm_position="post", position="none")
    block = Block(cfg).eval()
    a, f = [0.5, -1.0, 0.2], [0.1, 0.4, -0.3]
    block.attn, block.ffn = Fixed(a), Fixed(f)
    x = torch.tensor([1.0, 2.0, 4.0])

    def norm(v):
        return (v - v.mean()) / v.var(unbiased=False).sqrt()

    r = norm(x + torch.tensor(a))
    expected = norm(r + torch.tensor(f))
    torch.testing.assert_close(block(x[None, None])[0, 0], expected)


def twin_blocks():
    torch.manual_seed(0)
    pre = Block(TransformerConfig(d_model=16, n_heads=4, norm_position="pre", position="none"))
    post = Block(TransformerConfig(d_model=16, n_heads=4, norm_position="post", position="none"))
    post.load_state_dict(pre.state_dict())
    for p in pre.parameters():  # non-trivial norms, so the two really differ in their weights' use
        nn.init.normal_(p, 0.0, 0.3)
    post.load_state_dict(pre.state_dict())
    return pre, post


def test_pre_and_post_norm_differ_in_output_and_gradient():
    pre, post = twin_blocks()
    x = torch.randn(2, 5, 16)
    y_pre, y_post = pre(x), post(x)
    assert y_pre.shape == y_post.shape == x.shape
    assert (y_pre - y_post).abs().max() > 0.1
    y_pre.square().sum().backward()
    y_post.square().sum().backward()
    g_pre, g_post = pre.attn.qkv.weight.grad, post.attn.qkv.weight.grad
    assert (g_pre - g_post).norm() / g_pre.norm() > 0.1


def copy_linear(dst: nn.Linear, weight, bias):
    dst.weight.data.copy_(weight)
    dst.bias.data.copy_(bias)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_equals_torch_encoder_layer(norm_first):
    torch.manual_seed(0)
    d, h, ff = 32, 4, 64
    ref = nn.TransformerEncoderLayer(d, h, ff, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    cfg = TransformerConfig(
        arch="encoder", d_model=d, n_heads=h, d_ff=ff, ffn="relu", position="none",
        norm_position="pre" if norm_first else "post",
    )
    block = Block(cfg).eval()
    copy_linear(block.attn.qkv, ref.self_attn.in_proj_weight, ref.self_attn.in_proj_bias)
    copy_linear(block.attn.out, ref.self_attn.out_proj.weight, ref.self_attn.out_proj.bias)
    copy_linear(block.ffn.up, ref.linear1.weight, ref.linear1.bias)
    copy_linear(block.ffn.down, ref.linear2.weight, ref.linear2.bias)
    block.attn_norm.load_state_dict(ref.norm1.state_dict())
    block.ffn_norm.load_state_dict(ref.norm2.state_dict())
    x = torch.randn(3, 7, d)
    torch.testing.assert_close(block(x), ref(x), atol=1e-5, rtol=1e-5)
    # With a key-padding mask: torch's mask is True for padding, ours True for real tokens.
    real = torch.tensor([[True] * 7, [True] * 4 + [False] * 3, [True] * 2 + [False] * 5])
    ours = block(x, AttnInputs(mask=real[:, None, None, :]))
    theirs = ref(x, src_key_padding_mask=~real)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_equals_torch_decoder_layer(norm_first):
    torch.manual_seed(0)
    d, h, ff = 32, 4, 64
    ref = nn.TransformerDecoderLayer(d, h, ff, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    cfg = TransformerConfig(
        arch="encoder-decoder", d_model=d, n_heads=h, d_ff=ff, ffn="relu", position="none",
        norm_position="pre" if norm_first else "post",
    )
    block = Block(cfg, causal=True, cross=True).eval()
    copy_linear(block.attn.qkv, ref.self_attn.in_proj_weight, ref.self_attn.in_proj_bias)
    copy_linear(block.attn.out, ref.self_attn.out_proj.weight, ref.self_attn.out_proj.bias)
    copy_linear(block.cross_attn.q, ref.multihead_attn.in_proj_weight[:d], ref.multihead_attn.in_proj_bias[:d])
    copy_linear(block.cross_attn.kv, ref.multihead_attn.in_proj_weight[d:], ref.multihead_attn.in_proj_bias[d:])
    copy_linear(block.cross_attn.out, ref.multihead_attn.out_proj.weight, ref.multihead_attn.out_proj.bias)
    copy_linear(block.ffn.up, ref.linear1.weight, ref.linear1.bias)
    copy_linear(block.ffn.down, ref.linear2.weight, ref.linear2.bias)
    block.attn_norm.load_state_dict(ref.norm1.state_dict())
    block.cross_norm.load_state_dict(ref.norm2.state_dict())
    block.ffn_norm.load_state_dict(ref.norm3.state_dict())
    x, memory = torch.randn(2, 6, d), torch.randn(2, 9, d)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    theirs = ref(x, memory, tgt_mask=causal, tgt_is_causal=True)
    ours = block(x, AttnInputs(is_causal=True), AttnInputs(memory=memory))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
