"""BERT (Devlin et al. 2019): a Post-Norm encoder with learned positions, token-type
(segment) embeddings and a LayerNorm on the embeddings; optionally its masked-LM head
(dense + GELU + LayerNorm, then the tied embedding plus a bias) and its pooler.

Q, K and V are separate ``nn.Linear`` layers: fused on import, split on export. The head
and the pooler are imported when the file has them (``BertForMaskedLM``, ``BertModel``).
"""

from __future__ import annotations

import torch

from ...config import TransformerConfig
from ...errors import UsageError
from ..rules import Rule, linear, norm
from .base import SHAPE, Family, activation_from_hf, activation_to_hf, flag, integer, need, number, refuse, text

HEAD = "cls.predictions."


def config_from_hf(hf: dict, has, where: str) -> TransformerConfig:
    if text(hf, "position_embedding_type", where, "absolute") != "absolute":
        raise refuse(where, "position_embedding_type", hf["position_embedding_type"], "expected absolute")
    if flag(hf, "is_decoder", where, False):
        raise refuse(where, "is_decoder", True, "blockformer imports BERT as an encoder")
    ffn, approx = activation_from_hf(text(hf, "hidden_act", where, "gelu"), "hidden_act", where)
    return TransformerConfig(
        arch="encoder", vocab_size=need(hf, "vocab_size", where), d_model=need(hf, "hidden_size", where),
        n_layers=need(hf, "num_hidden_layers", where), n_heads=need(hf, "num_attention_heads", where),
        d_ff=need(hf, "intermediate_size", where), max_seq_len=need(hf, "max_position_embeddings", where),
        norm="layer", norm_eps=number(hf, "layer_norm_eps", where, 1e-12), norm_position="post", ffn=ffn,
        gelu_approximate=approx, position="learned", bias=True, tie_embeddings=True, scale_embeddings=False,
        n_token_types=integer(hf, "type_vocab_size", where, 2, minimum=0), embedding_norm=True,
        head_transform=has(HEAD + "transform.dense.weight"), head_bias=has(HEAD + "transform.dense.weight"),
        pooler=has("bert.pooler.dense.weight"),
    )


def check(cfg: TransformerConfig) -> None:
    if cfg.head_bias != cfg.head_transform:
        raise UsageError(f"model.head_bias={cfg.head_bias!r} with head_transform={cfg.head_transform!r} has no "
                         f"counterpart in Hugging Face bert; expected head_bias == head_transform (BERT's MLM head "
                         f"has both or neither)")


def config_to_hf(cfg: TransformerConfig, ids: dict[str, int]) -> dict:
    # BertForMaskedLM has no pooler: a model with both is BertForPreTraining (NSP head zero).
    arch = ("BertForPreTraining" if cfg.pooler else "BertForMaskedLM") if cfg.head_transform else "BertModel"
    return {
        "model_type": "bert", "architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.d_ff,
        "hidden_act": activation_to_hf(cfg), "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": max(cfg.n_token_types, 1), "layer_norm_eps": cfg.norm_eps,
        "position_embedding_type": "absolute", "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout, "pad_token_id": ids["pad"],
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }


def rules(cfg: TransformerConfig) -> list[Rule]:
    p = "bert."
    out = [Rule("embed.tokens.weight", (p + "embeddings.word_embeddings.weight",), vocab=True),
           Rule("embed.position.table.weight", (p + "embeddings.position_embeddings.weight",))]
    if cfg.n_token_types:
        out.append(Rule("embed.token_types.weight", (p + "embeddings.token_type_embeddings.weight",)))
    out += norm("embed.norm", p + "embeddings.LayerNorm", bias=True)
    for i in range(cfg.n_layers):
        b, t = f"encoder.blocks.{i}.", f"{p}encoder.layer.{i}."
        qkv = tuple(t + f"attention.self.{n}" for n in ("query", "key", "value"))
        out += linear(b + "attn.qkv", qkv, bias=True, sizes=(cfg.d_model,) * 3)
        out += linear(b + "attn.out", t + "attention.output.dense", bias=True)
        out += norm(b + "attn_norm", t + "attention.output.LayerNorm", bias=True)
        out += linear(b + "ffn.up", t + "intermediate.dense", bias=True)
        out += linear(b + "ffn.down", t + "output.dense", bias=True)
        out += norm(b + "ffn_norm", t + "output.LayerNorm", bias=True)
    if cfg.pooler:
        out += linear("pooler.dense", p + "pooler.dense", bias=True)
    if cfg.head_transform:
        out += linear("head_transform.dense", HEAD + "transform.dense", bias=True)
        out += norm("head_transform.norm", HEAD + "transform.LayerNorm", bias=True)
        out.append(Rule("head.bias", (HEAD + "bias",), vocab=True))
    return out


def ignore(cfg: TransformerConfig) -> list[str]:
    # position_ids: a buffer; the NSP head is not a blockformer task; the decoder is the tied embedding.
    return [r".*position_ids$", r"cls\.seq_relationship\..*", r"cls\.predictions\.decoder\..*"]


def extra(cfg: TransformerConfig) -> dict:
    out = {}
    if not cfg.n_token_types:  # BERT always adds a segment vector: with no token types, a zero row adds nothing
        out["bert.embeddings.token_type_embeddings.weight"] = torch.zeros(1, cfg.d_model)
    if cfg.pooler and cfg.head_transform:  # BertForPreTraining's next-sentence head, which blockformer lacks
        out.update({"cls.seq_relationship.weight": torch.zeros(2, cfg.d_model), "cls.seq_relationship.bias": torch.zeros(2)})
    return out


FAMILY = Family(
    name="bert", model_types=("bert",),
    signature={"arch": ("encoder",), "position": ("learned",)},
    mapped=(*SHAPE, "gelu_approximate", "n_token_types", "head_transform", "head_bias", "pooler"),
    fixed={"norm": ("layer",),
           "norm_position": ("post",), "ffn": ("gelu", "relu", "silu"),
           "bias": (True,), "scale_embeddings": (False,), "tie_embeddings": (True,), "embedding_norm": (True,)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
    prefix="bert.", outside=("cls.",), ignore=ignore, extra=extra, check=check,
)
