"""BART (Lewis et al. 2020) and Marian (Junczys-Dowmunt et al. 2018): Post-Norm
encoder-decoders with biases, the original Transformer's shape, and a ``final_logits_bias``.

BART: learned positions whose table starts at row 2 (``position_offset=2``) and a LayerNorm
on the embeddings. Marian: fixed sinusoids with all sines before all cosines
(``sinusoid_layout="split"``), embeddings scaled by sqrt(d_model), SiLU FFN. Both share one
embedding between encoder, decoder and (tied) head.
"""

from __future__ import annotations

import torch

from ...config import TransformerConfig
from ...nn.position import sinusoidal_table
from ..rules import Rule, linear, norm
from .base import SHAPE, Family, activation_from_hf, activation_to_hf, equal_or_refuse, flag, need, refuse, text


def _config_from_hf(hf: dict, has, where: str, marian: bool) -> TransformerConfig:
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        equal_or_refuse(hf, a, b, where)
    for key in ("normalize_before", "add_final_layer_norm", "normalize_embedding" if marian else ""):
        if key and flag(hf, key, where, False):
            raise refuse(where, key, hf[key], "blockformer imports the Post-Norm layout of this family")
    if marian and not flag(hf, "share_encoder_decoder_embeddings", where, True):
        raise refuse(where, "share_encoder_decoder_embeddings", False, "blockformer's source and target share one vocabulary here")
    ffn, approx = activation_from_hf(text(hf, "activation_function", where, "gelu"), "activation_function", where)
    return TransformerConfig(
        arch="encoder-decoder", vocab_size=need(hf, "vocab_size", where), d_model=need(hf, "d_model", where),
        n_layers=need(hf, "encoder_layers", where), n_encoder_layers=need(hf, "encoder_layers", where),
        n_decoder_layers=need(hf, "decoder_layers", where), n_heads=need(hf, "encoder_attention_heads", where),
        d_ff=need(hf, "encoder_ffn_dim", where), max_seq_len=need(hf, "max_position_embeddings", where),
        norm="layer", norm_eps=1e-5, norm_position="post", ffn=ffn, gelu_approximate=approx,
        position="sinusoidal" if marian else "learned", sinusoid_layout="split" if marian else "interleaved",
        position_offset=0 if marian else 2, embedding_norm=not marian, bias=True,
        tie_embeddings=flag(hf, "tie_word_embeddings", where, True),
        scale_embeddings=flag(hf, "scale_embedding", where, False), head_bias=True,
    )


def _config_to_hf(cfg: TransformerConfig, ids: dict[str, int], marian: bool) -> dict:
    out = {
        "model_type": "marian" if marian else "bart",
        "architectures": ["MarianMTModel" if marian else "BartForConditionalGeneration"],
        "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "encoder_layers": cfg.n_encoder_layers,
        "decoder_layers": cfg.n_decoder_layers, "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads, "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        "activation_function": activation_to_hf(cfg), "max_position_embeddings": cfg.max_seq_len,
        "scale_embedding": cfg.scale_embeddings, "dropout": cfg.dropout, "attention_dropout": cfg.attention_dropout,
        "activation_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "is_encoder_decoder": True,
        "pad_token_id": ids["pad"], "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
        # blockformer's targets start at bos (BART's own start at eos, Marian's at pad), and no eos is forced.
        "decoder_start_token_id": ids["bos"], "forced_eos_token_id": None,
        "torch_dtype": "float32",
    }
    if marian:
        out.update(share_encoder_decoder_embeddings=True, decoder_vocab_size=cfg.vocab_size)
    return out


def rules(cfg: TransformerConfig) -> list[Rule]:
    p = "model."
    out = [Rule("tgt_embed.tokens.weight", (p + "shared.weight",), vocab=True)]
    if not cfg.tie_embeddings:  # transformers then ties no stack to `shared`: each is written too
        out += [Rule("src_embed.tokens.weight", (p + "shared.weight",), vocab=True),
                Rule("src_embed.tokens.weight", (p + "encoder.embed_tokens.weight",), vocab=True),
                Rule("tgt_embed.tokens.weight", (p + "decoder.embed_tokens.weight",), vocab=True),
                Rule("head.weight", ("lm_head.weight",), vocab=True)]
    if cfg.head_bias:
        out.append(Rule("head.bias", ("final_logits_bias",), flat=True, vocab=True))
    for ours, side, n_layers in (("src_embed", "encoder", cfg.n_encoder_layers), ("tgt_embed", "decoder", cfg.n_decoder_layers)):
        if cfg.position == "learned":
            out.append(Rule(f"{ours}.position.table.weight", (f"{p}{side}.embed_positions.weight",)))
        if cfg.embedding_norm:
            out += norm(f"{ours}.norm", f"{p}{side}.layernorm_embedding", bias=True)
        for i in range(n_layers):
            b, t = f"{side}.blocks.{i}.", f"{p}{side}.layers.{i}."
            d = cfg.d_model
            out += linear(b + "attn.qkv", tuple(f"{t}self_attn.{n}_proj" for n in "qkv"), bias=True, sizes=(d, d, d))
            out += linear(b + "attn.out", t + "self_attn.out_proj", bias=True)
            out += norm(b + "attn_norm", t + "self_attn_layer_norm", bias=True)
            if side == "decoder":
                out += linear(b + "cross_attn.q", t + "encoder_attn.q_proj", bias=True)
                out += linear(b + "cross_attn.kv", (t + "encoder_attn.k_proj", t + "encoder_attn.v_proj"), bias=True,
                              sizes=(d, d))
                out += linear(b + "cross_attn.out", t + "encoder_attn.out_proj", bias=True)
                out += norm(b + "cross_norm", t + "encoder_attn_layer_norm", bias=True)
            out += linear(b + "ffn.up", t + "fc1", bias=True)
            out += linear(b + "ffn.down", t + "fc2", bias=True)
            out += norm(b + "ffn_norm", t + "final_layer_norm", bias=True)
    return out


def ignore(cfg: TransformerConfig) -> list[str]:
    out = [r"model\.(encoder|decoder)\.embed_tokens\.weight"] + (["lm_head.weight"] if cfg.tie_embeddings else [])
    if cfg.position == "sinusoidal":  # a function of the config (checked against ours on import)
        out.append(r"model\.(encoder|decoder)\.embed_positions\.weight")
    return out


def extra(cfg: TransformerConfig) -> dict:
    out = {} if cfg.head_bias else {"final_logits_bias": torch.zeros(1, cfg.vocab_size)}
    if cfg.position == "sinusoidal":
        table = sinusoidal_table(cfg.max_seq_len, cfg.d_model, cfg.sinusoid_layout)
        out.update({f"model.{s}.embed_positions.weight": table for s in ("encoder", "decoder")})
    return out


_MAPPED = (*SHAPE, "n_encoder_layers", "n_decoder_layers", "gelu_approximate", "tie_embeddings", "scale_embeddings",
           "head_bias")
_FIXED = {"norm": ("layer",), "norm_position": ("post",), "bias": (True,),
          "ffn": ("gelu", "relu", "silu"), "norm_eps": (1e-5,)}

BART = Family(
    name="bart", model_types=("bart",),
    signature={"arch": ("encoder-decoder",), "position": ("learned",)},
    mapped=_MAPPED, fixed={**_FIXED, "position_offset": (2,), "embedding_norm": (True,)},
    config_from_hf=lambda hf, has, where: _config_from_hf(hf, has, where, marian=False),
    config_to_hf=lambda cfg, ids: _config_to_hf(cfg, ids, marian=False), rules=rules,
    outside=("lm_head.", "final_logits_bias"), prefix="model.", ignore=ignore, extra=extra,
    aliases={"model.shared.weight": ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"),
             # files written by older transformers keep only `shared`
             **{f"model.{s}.embed_tokens.weight": ("model.shared.weight",) for s in ("encoder", "decoder")}},
)
MARIAN = Family(
    name="marian", model_types=("marian",),
    signature={"arch": ("encoder-decoder",), "position": ("sinusoidal",)},
    mapped=_MAPPED, fixed={**_FIXED, "sinusoid_layout": ("split",)},
    config_from_hf=lambda hf, has, where: _config_from_hf(hf, has, where, marian=True),
    config_to_hf=lambda cfg, ids: _config_to_hf(cfg, ids, marian=True), rules=rules,
    outside=("lm_head.", "final_logits_bias"), prefix="model.", ignore=ignore, extra=extra,
    aliases=BART.aliases,
)
