"""Llama (Touvron et al. 2023) and Mistral (Jiang et al. 2023): a Pre-Norm decoder with
RMSNorm, rotary positions (unscaled or linearly scaled), SwiGLU and grouped-query attention;
Mistral's sliding window is blockformer's ``attention_window``.

Hugging Face stores q/k projections in the rotate-half rope layout, blockformer's own, so
importing copies them; a blockformer model with ``rope_interleaved`` has its q/k rows
re-ordered on export (``rules.interleaved_to_half``). Q, K, V and gate/up are fused.
"""

from __future__ import annotations

from ...config import TransformerConfig
from ...nn.position import rope_base_of
from ..rules import Rule, linear, norm
from .base import SHAPE, Family, flag, integer, mapping, need, number, refuse, text


def _rope(hf: dict, where: str) -> dict:
    """rope_base, and rope_scaling with its factor: unscaled, or linear (position interpolation)."""
    params, scaling = mapping(hf, "rope_parameters", where), mapping(hf, "rope_scaling", where)
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in ("default", "linear"):
        raise refuse(where, "rope_scaling", kind, "blockformer imports unscaled or linear rope")
    if "rope_theta" in params:
        base = number(params, "rope_theta", f"{where}: rope_parameters", 10000.0)
    else:
        base = number(hf, "rope_theta", where, 10000.0)
    if kind == "default":
        return {"rope_base": base}
    factor = number(params if "factor" in params else scaling, "factor", f"{where}: rope_scaling", 1.0)
    return {"rope_base": base, "rope_scaling": "linear", "rope_scaling_factor": factor}


def config_from_hf(hf: dict, has, where: str) -> TransformerConfig:
    if text(hf, "hidden_act", where, "silu") not in ("silu", "swish"):
        raise refuse(where, "hidden_act", hf["hidden_act"], "expected silu (SwiGLU)")
    bias = flag(hf, "attention_bias", where, False)
    if bias != flag(hf, "mlp_bias", where, False):
        raise refuse(where, "attention_bias", hf.get("attention_bias"), "blockformer's bias is one flag for attention and MLP")
    d_model, n_heads = need(hf, "hidden_size", where), need(hf, "num_attention_heads", where)
    if integer(hf, "head_dim", where, None) not in (None, d_model // n_heads):
        raise refuse(where, "head_dim", hf["head_dim"], f"blockformer's head size is hidden_size / heads = {d_model // n_heads}")
    window, max_len = integer(hf, "sliding_window", where, None), need(hf, "max_position_embeddings", where)
    windowed = window is not None and flag(hf, "use_sliding_window", where, True) and window < max_len
    return TransformerConfig(
        arch="decoder", vocab_size=need(hf, "vocab_size", where), d_model=d_model,
        n_layers=need(hf, "num_hidden_layers", where), n_heads=n_heads,
        n_kv_heads=integer(hf, "num_key_value_heads", where, n_heads), d_ff=need(hf, "intermediate_size", where),
        max_seq_len=max_len, norm="rms", norm_eps=number(hf, "rms_norm_eps", where, 1e-6), norm_position="pre",
        ffn="swiglu", position="rope", **_rope(hf, where), bias=bias,
        tie_embeddings=flag(hf, "tie_word_embeddings", where, False), scale_embeddings=False,
        attention_window=window if windowed else 0,
    )


def config_to_hf(cfg: TransformerConfig, ids: dict[str, int]) -> dict:
    # "ntk" scaling is a static change of base; "linear" is transformers' linear rope type.
    base, rope = rope_base_of(cfg), {"rope_type": "default"}
    if cfg.rope_scaling == "linear":
        base, rope = cfg.rope_base, {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    kind = "mistral" if cfg.attention_window else "llama"  # Mistral's sliding window is blockformer's window
    return {
        "model_type": kind, "architectures": [f"{kind.capitalize()}ForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "rope_theta": base, "rope_parameters": {**rope, "rope_theta": base},
        **({"rope_scaling": rope} if cfg.rope_scaling == "linear" else {}),
        **({"sliding_window": cfg.attention_window} if cfg.attention_window else {}),
        "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"], "torch_dtype": "float32",
    }


def rules(cfg: TransformerConfig) -> list[Rule]:
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = [Rule("embed.tokens.weight", ("model.embed_tokens.weight",), vocab=True)]
    for i in range(cfg.n_layers):
        b, t = f"decoder.blocks.{i}.", f"model.layers.{i}."
        out += norm(b + "attn_norm", t + "input_layernorm", bias=False)
        out += linear(b + "attn.qkv", tuple(t + f"self_attn.{n}_proj" for n in "qkv"), bias=cfg.bias,
                      sizes=(q, kv, kv), rope=((0, cfg.n_heads), (1, cfg.n_kv_heads)))
        out += linear(b + "attn.out", t + "self_attn.o_proj", bias=cfg.bias)
        out += norm(b + "ffn_norm", t + "post_attention_layernorm", bias=False)
        out += linear(b + "ffn.up", (t + "mlp.gate_proj", t + "mlp.up_proj"), bias=cfg.bias, sizes=(cfg.d_ff, cfg.d_ff))
        out += linear(b + "ffn.down", t + "mlp.down_proj", bias=cfg.bias)
    out += norm("decoder.final_norm", "model.norm", bias=False)
    if not cfg.tie_embeddings:
        out.append(Rule("head.weight", ("lm_head.weight",), vocab=True))
    return out


def ignore(cfg: TransformerConfig) -> list[str]:
    return [r".*rotary_emb\.inv_freq$"] + (["lm_head.weight"] if cfg.tie_embeddings else [])


FAMILY = Family(
    name="llama", model_types=("llama", "mistral"),
    signature={"arch": ("decoder",), "position": ("rope",)},
    mapped=(*SHAPE, "n_kv_heads", "rope_base", "rope_scaling", "rope_scaling_factor", "attention_window", "bias",
            "tie_embeddings"),
    fixed={"rope_interleaved": (False, True), "norm": ("rms",), "norm_position": ("pre",),
           "ffn": ("swiglu",), "scale_embeddings": (False,)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
    prefix="model.", outside=("lm_head.",), ignore=ignore,
)
