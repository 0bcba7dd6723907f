"""Attention, ALiBi and residuals against references written out by hand (issue 21,
section 2): the paper's ALiBi slopes and BLOOM's bias, grouped-query attention on every
path (fused, masked, biased, unfused for dropout, KV cache, cross), attention dropout,
and the scaled and gated residual formulas."""

from __future__ import annotations

import math

import pytest
import torch

from blockformer import kernels
from blockformer.config import TransformerConfig
from blockformer.nn import attention as attention_module
from blockformer.nn.attention import Attention, AttnInputs
from blockformer.nn.block import Block
from blockformer.nn.kv_cache import KVCache
from blockformer.nn.position import AlibiBias, alibi_slopes
from blockformer.nn.residual import Residual
from blockformer.nn.stack import Stack


def config(**kw) -> TransformerConfig:
    base = dict(d_model=32, n_heads=4, n_layers=2, vocab_size=50, max_seq_len=32, position="none")
    return TransformerConfig(**{**base, **kw})


def split_qkv(attn: Attention, x: torch.Tensor, memory: torch.Tensor | None = None):
    """q (B, H, T, hd), k and v (B, H_kv, S, hd) from the layer's own weights."""
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    B, T, _ = x.shape
    if memory is None:
        q, k, v = attn.qkv(x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    else:
        q, (k, v) = attn.q(x), attn.kv(memory).chunk(2, dim=-1)

    def heads(t, n):
        return t.view(B, t.shape[1], n, hd).transpose(1, 2)

    return heads(q, H), heads(k, Hkv), heads(v, Hkv)


def reference_attention(attn, x, *, memory=None, causal=False, key_valid=None, bias=None, k=None, v=None):
    """softmax(q k^T / sqrt(hd) + bias) v, query head h reading key/value head h // (H / H_kv)."""
    q, k0, v0 = split_qkv(attn, x, memory)
    k, v = (k0, v0) if k is None else (k, v)
    group = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, hd)
    scores = q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)
    if bias is not None:
        scores = scores + bias
    T, S = scores.shape[-2:]
    if causal:
        future = torch.ones(T, S, dtype=torch.bool).tril(S - T).logical_not()  # the last T of S queries
        scores = scores.masked_fill(future, float("-inf"))
    if key_valid is not None:
        scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    y = scores.softmax(-1) @ v  # (B, H, T, hd)
    return attn.out(y.transpose(1, 2).reshape(x.shape[0], T, -1))


# ---------------------------------------------------------------------- 4. ALiBi
def test_alibi_slopes_are_the_papers():
    """Press et al. 2022: 2^-1 ... 2^-8 for 8 heads; 12 heads take those 8, then every other
    slope of the 16-head sequence (2^-0.5, 2^-1.5, ...), the first 4."""
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    twelve = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(twelve), rtol=1e-6, atol=0)
    assert alibi_slopes(4).tolist() == [0.25, 0.0625, 2.0 ** -6, 2.0 ** -8]


@pytest.mark.parametrize("n_heads", [8, 12])
def test_alibi_bias_matches_bloom_up_to_a_per_query_shift(n_heads):
    """BLOOM's ``build_alibi_tensor`` adds ``slope * key_position``; ours adds ``-slope * |i - j|``.
    Over the causal keys (j <= i) the two differ by ``-slope * i``, the same for every key of a
    row, which softmax ignores: farther keys get the more negative bias."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    T = 10
    theirs = bloom.build_alibi_tensor(torch.ones(1, T, dtype=torch.long), n_heads, torch.float32)  # (H, 1, T)
    pos = torch.arange(T)[None]
    ours = AlibiBias(config(n_heads=n_heads, d_model=8 * n_heads), causal=True)(pos, pos)[0]  # (H, T, T)
    shift = ours - theirs  # (H, T, T)
    slopes = theirs[:, 0, 1]  # key position 1: the slope itself
    for i in range(T):
        torch.testing.assert_close(shift[:, i, : i + 1], (-slopes * i)[:, None].expand(-1, i + 1),
                                   rtol=1e-6, atol=1e-6)
    assert (ours[:, 5, :5].diff(dim=-1) > 0).all()  # nearer key, larger bias


def test_alibi_attention_outputs_equal_a_hand_written_softmax():
    """A decoder stack with ALiBi: its first layer's attention equals
    softmax(q k^T / sqrt(hd) - slope_h |i - j|) v under the causal mask; an encoder's sees
    both directions with the same symmetric bias."""
    torch.manual_seed(0)
    for causal in (True, False):
        cfg = config(n_heads=8, d_model=64, position="alibi", n_kv_heads=2)
        stack = Stack(cfg, 1, causal=causal).eval()
        attn = stack.blocks[0].attn
        x, pos = torch.randn(2, 7, 64), torch.arange(7).expand(2, 7)
        ctx = stack._self_inputs(pos, None, None, None)
        slopes = torch.tensor([2.0 ** -i for i in range(1, 9)])[:, None, None]
        bias = -slopes * (pos[0][:, None] - pos[0][None, :]).abs().float()  # (H, T, T)
        with torch.no_grad():
            torch.testing.assert_close(attn(x, ctx), reference_attention(attn, x, causal=causal, bias=bias),
                                       rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- 5. grouped-query attention
def gqa_layer(n_heads=4, n_kv_heads=2, **kw) -> Attention:
    torch.manual_seed(0)
    return Attention(config(n_heads=n_heads, n_kv_heads=n_kv_heads, **kw))


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_fused_masked_and_biased_paths_read_their_own_kv_group(n_kv_heads):
    """The fused kernel (causal, no mask), a bool padding mask and a float bias: each
    query head h reads key/value head h // (n_heads / n_kv_heads)."""
    attn = gqa_layer(n_kv_heads=n_kv_heads).eval()
    x = torch.randn(2, 6, 32)
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    bias = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        for ctx, ref in ((AttnInputs(is_causal=True), reference_attention(attn, x, causal=True)),
                         (AttnInputs(mask=mask), reference_attention(attn, x, causal=True, key_valid=valid)),
                         (AttnInputs(mask=bias), reference_attention(attn, x, bias=bias))):
            torch.testing.assert_close(attn(x, ctx), ref, rtol=1e-5, atol=1e-5)


def test_gqa_on_the_unfused_path_reads_its_own_kv_group(monkeypatch):
    """Attention dropout sends a CPU training step to the unfused kernel. At p = 1e-6 (which
    the cheap dropout mask resolves to 0 of 65536 levels: nothing dropped) the output must
    equal the reference; with a bool mask and with a float bias too."""
    calls = []
    unfused = attention_module._unfused
    monkeypatch.setattr(attention_module, "_unfused", lambda *a: calls.append(1) or unfused(*a))
    attn = gqa_layer(n_heads=6, n_kv_heads=2, d_model=36, attention_dropout=1e-6).train()
    x = torch.randn(2, 5, 36)
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    bias = torch.randn(2, 6, 5, 5)
    torch.testing.assert_close(attn(x, AttnInputs(is_causal=True)), reference_attention(attn, x, causal=True),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn(x, AttnInputs(mask=valid[:, None, None, :])),
                               reference_attention(attn, x, key_valid=valid), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn(x, AttnInputs(mask=bias)), reference_attention(attn, x, bias=bias),
                               rtol=1e-5, atol=1e-5)
    assert len(calls) == 3


def test_gqa_on_the_unfused_bf16_path_reads_its_own_kv_group(monkeypatch):
    """bf16 training over short keys takes the unfused kernel on CPUs with AVX512-BF16 and no
    AMX; forced here on any CPU. Against the fp32 reference of the same (bf16) weights, to
    bf16's rounding: 8 bits of mantissa, scores summed over head_dim 8."""
    monkeypatch.setattr(kernels, "UNFUSED_SHORT_BF16", True)
    calls = []
    unfused = attention_module._unfused
    monkeypatch.setattr(attention_module, "_unfused", lambda *a: calls.append(1) or unfused(*a))
    attn = gqa_layer(n_heads=4, n_kv_heads=2).to(torch.bfloat16).train()
    x = torch.randn(2, 6, 32).to(torch.bfloat16)
    y = attn(x, AttnInputs(is_causal=True))
    assert calls == [1]
    ref = reference_attention(attn.float(), x.float(), causal=True)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_gqa_with_a_kv_cache_decodes_like_the_full_sequence():
    """Prefill 5 tokens into a cache holding n_kv_heads heads, then decode 2 one at a time:
    each step equals the reference's row for that position over all keys so far."""
    attn = gqa_layer(n_heads=4, n_kv_heads=2).eval()
    x = torch.randn(1, 7, 32)
    ref = reference_attention(attn, x, causal=True)
    cache = KVCache(1, 1, 8, 2, attn.head_dim)
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 6), (6, 7)):
            cache_pos = torch.arange(start, stop)
            cache.record(cache_pos, cache_pos[None], None)
            mask = (cache_pos[:, None] >= torch.arange(cache.span)[None, :])[None, None]
            y = attn(x[:, start:stop], AttnInputs(mask=mask, cache=cache, cache_pos=cache_pos))
            torch.testing.assert_close(y, ref[:, start:stop], rtol=1e-5, atol=1e-5)


def test_gqa_cross_attention_reads_its_own_kv_group():
    """From the encoder output, and when decoding from the keys and values the first call cached."""
    torch.manual_seed(0)
    attn = Attention(config(n_heads=4, n_kv_heads=2), cross=True).eval()
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 6, 32)
    valid = torch.tensor([[True] * 6, [True] * 2 + [False] * 4])
    mask = valid[:, None, None, :]
    ref = reference_attention(attn, x, memory=memory, key_valid=valid)
    cache = KVCache(1, 2, 4, 2, attn.head_dim)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, AttnInputs(mask=mask, memory=memory)), ref, rtol=1e-5, atol=1e-5)
        attn(x[:, :1], AttnInputs(mask=mask, memory=memory, cache=cache))  # the first step fills the cache
        torch.testing.assert_close(attn(x[:, 1:], AttnInputs(mask=mask, cache=cache)), ref[:, 1:],
                                   rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- 6. attention dropout
def test_attention_dropout_is_off_in_eval_and_on_in_training():
    """With p = 0.5: in eval the output equals the reference (grad enabled or not); in
    training two draws differ from it and from each other, the same seed reproduces a draw,
    and the mean of many draws is the reference within its standard error (kept weights are
    scaled by 1 / (1 - p))."""
    attn = gqa_layer(n_heads=2, n_kv_heads=2, attention_dropout=0.5)
    x = torch.randn(1, 6, 32)
    ctx = AttnInputs(is_causal=True)
    ref = reference_attention(attn, x, causal=True).detach()
    attn.eval()
    torch.testing.assert_close(attn(x, ctx), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, ctx), ref, rtol=1e-5, atol=1e-5)
    attn.train()
    torch.manual_seed(1)
    a = attn(x, ctx).detach()
    torch.manual_seed(1)
    assert torch.equal(attn(x, ctx).detach(), a)
    b = attn(x, ctx).detach()
    assert (a - ref).abs().max() > 1e-2 and (a - b).abs().max() > 1e-2
    n = 4000
    draws = attn(x.expand(n, -1, -1), ctx).detach()  # each row draws its own masks
    # Standard error of the mean, from the draws' own spread: 6 of them is far outside chance.
    err = (draws.mean(0) - ref).abs()
    assert (err <= 6 * draws.std(0) / math.sqrt(n) + 1e-6).all(), err.max()


# ---------------------------------------------------------------------- 7. scaled and gated residuals
def _with(kind: str, **kw) -> TransformerConfig:
    return config(residual=kind, n_layers=3, **kw)


def test_scaled_residual_puts_the_constant_on_the_branch_or_the_trunk():
    """``x + f / sqrt(2N)`` on the branch; DeepNet's ``(2N)^(1/4) x + f`` on the trunk
    (post-norm); an explicit ``residual_scale`` replaces the derived one."""
    x, f = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    N = 3
    torch.testing.assert_close(Residual(_with("scaled"), N)(x, f), x + f / math.sqrt(2 * N))
    trunk = _with("scaled", residual_scale_target="trunk", norm_position="post")
    torch.testing.assert_close(Residual(trunk, N)(x, f), (2 * N) ** 0.25 * x + f)
    torch.testing.assert_close(Residual(_with("scaled", residual_scale=0.3), N)(x, f), x + 0.3 * f)
    explicit = _with("scaled", residual_scale=1.7, residual_scale_target="trunk", norm_position="post")
    torch.testing.assert_close(Residual(explicit, N)(x, f), 1.7 * x + f)


def test_gated_residual_multiplies_the_branch_by_its_per_channel_gate():
    """Initialised at ``residual_gate_init``; with the gate set to arbitrary values,
    ``x + g * f`` channel by channel."""
    res = Residual(_with("gated", residual_gate_init=0.25), 3)
    assert torch.equal(res.gate.detach(), torch.full((32,), 0.25))
    x, f = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    with torch.no_grad():
        res.gate.copy_(torch.linspace(-2.0, 3.0, 32))
    torch.testing.assert_close(res(x, f), x + torch.linspace(-2.0, 3.0, 32) * f)


@pytest.mark.parametrize("kind", ["gated", "scaled"])
def test_a_block_applies_its_residuals_where_the_formulas_say(kind):
    """A pre-norm block: ``r = x + g1 * Attn(Norm(x))``, ``y = r + g2 * FFN(Norm(r))``; a
    post-norm DeepNet block: ``r = Norm(a x + Attn(x))``, ``y = Norm(a r + FFN(r))``."""
    torch.manual_seed(0)
    if kind == "gated":
        block = Block(_with("gated")).eval()
        g1, g2 = torch.randn(32), torch.randn(32)
        with torch.no_grad():
            block.attn_residual.gate.copy_(g1)
            block.ffn_residual.gate.copy_(g2)
    else:
        block = Block(_with("scaled", residual_scale_target="trunk", norm_position="post")).eval()
        a = 6 ** 0.25
    x = torch.randn(2, 5, 32)
    ctx = AttnInputs(is_causal=True)
    with torch.no_grad():
        if kind == "gated":
            r = x + g1 * block.attn(block.attn_norm(x), ctx)
            y = r + g2 * block.ffn(block.ffn_norm(r))
        else:
            r = block.attn_norm(a * x + block.attn(x, ctx))
            y = block.ffn_norm(a * r + block.ffn(r))
        torch.testing.assert_close(block(x, ctx), y)
