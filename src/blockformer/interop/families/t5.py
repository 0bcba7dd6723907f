"""T5 (Raffel et al. 2020): a Pre-Norm encoder-decoder with RMSNorm, no biases, unscaled
attention (the 1/sqrt(d) is folded into the initialisation) and a bucketed relative
position bias computed by each stack's first layer and shared by all its layers.

v1.0: ReLU FFN, tied head applied to ``hidden * d_model^-0.5``. v1.1: gated-GELU (tanh)
FFN, untied head, no scale. Encoder and decoder always share one embedding (``shared``).
"""

from __future__ import annotations

from ...config import TransformerConfig
from ...errors import UsageError
from ..rules import Rule, linear, norm
from .base import SHAPE, Family, flag, integer, need, number, refuse, text

FFNS = {"relu": ("relu", "none"), "gated-gelu": ("geglu", "tanh"), "gated-silu": ("swiglu", "none"),
        "gelu": ("gelu", "none"), "gated-relu": None}


def config_from_hf(hf: dict, has, where: str) -> TransformerConfig:
    proj = text(hf, "feed_forward_proj", where, "relu")
    if FFNS.get(proj) is None:
        raise refuse(where, "feed_forward_proj", proj, "expected relu, gelu, gated-gelu or gated-silu")
    ffn, approx = FFNS[proj]
    d_model, n_heads = need(hf, "d_model", where), need(hf, "num_heads", where)
    if need(hf, "d_kv", where) * n_heads != d_model:
        raise refuse(where, "d_kv", hf["d_kv"], f"blockformer's heads split d_model: expected d_model / num_heads = {d_model // n_heads}")
    tied = flag(hf, "tie_word_embeddings", where, True)
    scaled = flag(hf, "scale_decoder_outputs", where, tied)
    n_layers = need(hf, "num_layers", where)
    return TransformerConfig(
        arch="encoder-decoder", vocab_size=need(hf, "vocab_size", where), d_model=d_model, n_layers=n_layers,
        n_encoder_layers=n_layers, n_decoder_layers=integer(hf, "num_decoder_layers", where, n_layers), n_heads=n_heads,
        d_ff=need(hf, "d_ff", where), max_seq_len=integer(hf, "n_positions", where, 512), norm="rms",
        norm_eps=number(hf, "layer_norm_epsilon", where, 1e-6), norm_position="pre", ffn=ffn, gelu_approximate=approx,
        position="relative", relative_buckets=integer(hf, "relative_attention_num_buckets", where, 32),
        relative_max_distance=integer(hf, "relative_attention_max_distance", where, 128), bias=False,
        tie_embeddings=tied, scale_embeddings=False, attention_scale=1.0,
        output_scale=d_model**-0.5 if scaled else 1.0,
    )


def check(cfg: TransformerConfig) -> None:
    names = {v: k for k, v in FFNS.items() if v}
    if (cfg.ffn, cfg.gelu_approximate) not in names:
        raise UsageError(f"model.gelu_approximate={cfg.gelu_approximate!r} with ffn={cfg.ffn!r} has no counterpart "
                         f"in Hugging Face t5; expected {', '.join(f'{f}/{a}' for f, a in names)}")
    if cfg.output_scale not in (1.0, cfg.d_model**-0.5):
        raise UsageError(f"model.output_scale={cfg.output_scale!r} has no counterpart in Hugging Face t5; "
                         f"expected 1.0 or d_model^-0.5 = {cfg.d_model**-0.5!r}")


def config_to_hf(cfg: TransformerConfig, ids: dict[str, int]) -> dict:
    proj = {v: k for k, v in FFNS.items() if v}[(cfg.ffn, cfg.gelu_approximate)]
    return {
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model, "d_kv": cfg.head_dim, "d_ff": cfg.d_ff, "num_layers": cfg.n_encoder_layers,
        "num_decoder_layers": cfg.n_decoder_layers, "num_heads": cfg.n_heads, "n_positions": cfg.max_seq_len,
        "relative_attention_num_buckets": cfg.relative_buckets,
        "relative_attention_max_distance": cfg.relative_max_distance, "layer_norm_epsilon": cfg.norm_eps,
        "feed_forward_proj": proj, "tie_word_embeddings": cfg.tie_embeddings,
        "scale_decoder_outputs": cfg.output_scale != 1.0, "dropout_rate": cfg.dropout,
        "is_encoder_decoder": True, "pad_token_id": ids["pad"], "eos_token_id": ids["eos"],
        "bos_token_id": ids["bos"], "decoder_start_token_id": ids["bos"],  # blockformer's targets start at bos
        "torch_dtype": "float32",
    }


def _stack_rules(cfg: TransformerConfig, side: str, n_layers: int) -> list[Rule]:
    d, ff = cfg.d_model, cfg.d_ff
    out = [Rule(f"{side}.bias.table.weight", (f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",))]
    for i in range(n_layers):
        b, t = f"{side}.blocks.{i}.", f"{side}.block.{i}.layer."
        out += linear(b + "attn.qkv", tuple(f"{t}0.SelfAttention.{n}" for n in "qkv"), bias=False, sizes=(d, d, d))
        out += linear(b + "attn.out", f"{t}0.SelfAttention.o", bias=False)
        out += norm(b + "attn_norm", f"{t}0.layer_norm", bias=False)
        f = 1
        if side == "decoder":
            out += linear(b + "cross_attn.q", f"{t}1.EncDecAttention.q", bias=False)
            out += linear(b + "cross_attn.kv", (f"{t}1.EncDecAttention.k", f"{t}1.EncDecAttention.v"), bias=False,
                          sizes=(d, d))
            out += linear(b + "cross_attn.out", f"{t}1.EncDecAttention.o", bias=False)
            out += norm(b + "cross_norm", f"{t}1.layer_norm", bias=False)
            f = 2
        if cfg.ffn in ("geglu", "swiglu"):
            out += linear(b + "ffn.up", (f"{t}{f}.DenseReluDense.wi_0", f"{t}{f}.DenseReluDense.wi_1"), bias=False,
                          sizes=(ff, ff))
        else:
            out += linear(b + "ffn.up", f"{t}{f}.DenseReluDense.wi", bias=False)
        out += linear(b + "ffn.down", f"{t}{f}.DenseReluDense.wo", bias=False)
        out += norm(b + "ffn_norm", f"{t}{f}.layer_norm", bias=False)
    out += norm(f"{side}.final_norm", f"{side}.final_layer_norm", bias=False)
    return out


def rules(cfg: TransformerConfig) -> list[Rule]:
    out = [Rule("tgt_embed.tokens.weight", ("shared.weight",), vocab=True)]
    if not cfg.tie_embeddings:  # one matrix in T5: two copies here, checked equal on export
        out += [Rule("src_embed.tokens.weight", ("shared.weight",), vocab=True),
                Rule("head.weight", ("lm_head.weight",), vocab=True)]
    out += _stack_rules(cfg, "encoder", cfg.n_encoder_layers) + _stack_rules(cfg, "decoder", cfg.n_decoder_layers)
    return out


def ignore(cfg: TransformerConfig) -> list[str]:
    tied = [r"(encoder|decoder)\.embed_tokens\.weight"] + (["lm_head.weight"] if cfg.tie_embeddings else [])
    return tied + [r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight"]


FAMILY = Family(
    name="t5", model_types=("t5",),
    signature={"arch": ("encoder-decoder",), "position": ("relative",)},
    mapped=(*SHAPE, "n_encoder_layers", "n_decoder_layers", "gelu_approximate", "relative_buckets",
            "relative_max_distance", "tie_embeddings", "output_scale"),
    fixed={"norm": ("rms",), "norm_position": ("pre",),
           "ffn": ("relu", "gelu", "geglu", "swiglu"), "bias": (False,), "scale_embeddings": (False,),
           "attention_scale": (1.0,)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
    aliases={"shared.weight": ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}, ignore=ignore,
    check=check,
)
