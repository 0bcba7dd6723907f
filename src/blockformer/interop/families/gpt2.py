"""GPT-2 (Radford et al. 2019): a Pre-Norm decoder with learned positions and tanh GELU.

Its ``Conv1D`` layers store weights as (in, out): every matmul weight is transposed. The
attention's ``c_attn`` already fuses Q, K and V (columns q, k, v), as blockformer does.
"""

from __future__ import annotations

from ...config import TransformerConfig
from ..rules import Rule, linear, norm
from .base import SHAPE, Family, activation_from_hf, activation_to_hf, flag, integer, need, number, refuse, text


def config_from_hf(hf: dict, has, where: str) -> TransformerConfig:
    if flag(hf, "scale_attn_by_inverse_layer_idx", where, False):
        raise refuse(where, "scale_attn_by_inverse_layer_idx", True, "blockformer scales every layer alike")
    if flag(hf, "add_cross_attention", where, False):
        raise refuse(where, "add_cross_attention", True, "a GPT-2 with cross-attention is not a decoder-only model")
    ffn, approx = activation_from_hf(text(hf, "activation_function", where, "gelu_new"), "activation_function", where)
    d_model = need(hf, "n_embd", where)
    return TransformerConfig(
        arch="decoder", vocab_size=need(hf, "vocab_size", where), d_model=d_model,
        n_layers=need(hf, "n_layer", where), n_heads=need(hf, "n_head", where),
        d_ff=integer(hf, "n_inner", where, 4 * d_model), max_seq_len=need(hf, "n_positions", where),
        norm="layer", norm_eps=number(hf, "layer_norm_epsilon", where, 1e-5), norm_position="pre",
        ffn=ffn, gelu_approximate=approx, position="learned", bias=True,
        tie_embeddings=flag(hf, "tie_word_embeddings", where, True), scale_embeddings=False,
        attention_scale=None if flag(hf, "scale_attn_weights", where, True) else 1.0,
    )


def config_to_hf(cfg: TransformerConfig, ids: dict[str, int]) -> dict:
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": activation_to_hf(cfg), "scale_attn_weights": cfg.attention_scale is None,
        "tie_word_embeddings": cfg.tie_embeddings, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attention_dropout, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"], "torch_dtype": "float32",
    }


def rules(cfg: TransformerConfig) -> list[Rule]:
    p = "transformer."
    out = [Rule("embed.tokens.weight", (p + "wte.weight",), vocab=True),
           Rule("embed.position.table.weight", (p + "wpe.weight",))]
    for i in range(cfg.n_layers):
        b, t = f"decoder.blocks.{i}.", f"{p}h.{i}."
        out += norm(b + "attn_norm", t + "ln_1", bias=True)
        out += linear(b + "attn.qkv", t + "attn.c_attn", bias=True, transpose=True)
        out += linear(b + "attn.out", t + "attn.c_proj", bias=True, transpose=True)
        out += norm(b + "ffn_norm", t + "ln_2", bias=True)
        out += linear(b + "ffn.up", t + "mlp.c_fc", bias=True, transpose=True)
        out += linear(b + "ffn.down", t + "mlp.c_proj", bias=True, transpose=True)
    out += norm("decoder.final_norm", p + "ln_f", bias=True)
    if not cfg.tie_embeddings:
        out.append(Rule("head.weight", ("lm_head.weight",), vocab=True))
    return out


def ignore(cfg: TransformerConfig) -> list[str]:
    # Old files carry the causal-mask buffers; a tied head is the embedding again.
    return [r".*\.attn\.(masked_)?bias$"] + (["lm_head.weight"] if cfg.tie_embeddings else [])


FAMILY = Family(
    name="gpt2", model_types=("gpt2",),
    signature={"arch": ("decoder",), "position": ("learned",)},
    mapped=(*SHAPE, "tie_embeddings", "gelu_approximate"),
    fixed={"norm": ("layer",), "norm_position": ("pre",), "ffn": ("gelu", "relu", "silu"),
           "bias": (True,), "scale_embeddings": (False,), "attention_scale": (None, 1.0)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
    prefix="transformer.", outside=("lm_head.",), ignore=ignore,
)
