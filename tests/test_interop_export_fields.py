"""Export is strict by construction: for every ``TransformerConfig`` field, on a model of
every family, a value other than the family's own either exports with transformers' outputs
equal to blockformer's, or is refused in one line naming the field.

The cases are generated from the dataclass's fields and their types, so a field added to
``TransformerConfig`` later gets its cases without anyone writing them (and, until a family
maps it, its non-default values are refused)."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `test` extra installs it

from blockformer import TransformerConfig, build_model  # noqa: E402
from blockformer.errors import UsageError  # noqa: E402
from blockformer.interop import to_hf  # noqa: E402
from blockformer.interop.families import _FAMILIES, TRAINING_ONLY  # noqa: E402

V, B, T = 40, 2, 7
ATOL = 1e-5
_ENC_DEC = dict(arch="encoder-decoder", vocab_size=V, d_model=32, n_layers=2, n_encoder_layers=2, n_decoder_layers=2,
                n_heads=4, d_ff=48, max_seq_len=32, scale_embeddings=False)
BASES = {  # each family's own shape, as its import builds it
    "gpt2": dict(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32,
                 norm="layer", norm_position="pre", ffn="gelu", gelu_approximate="tanh", position="learned",
                 bias=True, tie_embeddings=True, scale_embeddings=False),
    "llama": dict(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=32, norm="rms", norm_eps=1e-6, norm_position="pre", ffn="swiglu", position="rope",
                  rope_base=500.0, bias=False, tie_embeddings=False, scale_embeddings=False),
    "bert": dict(arch="encoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32,
                 norm="layer", norm_eps=1e-12, norm_position="post", ffn="gelu", position="learned", bias=True,
                 tie_embeddings=True, scale_embeddings=False, n_token_types=2, embedding_norm=True,
                 head_transform=True, head_bias=True),
    "t5": dict(**_ENC_DEC, norm="rms", norm_eps=1e-6, norm_position="pre", ffn="relu", position="relative",
               relative_buckets=8, relative_max_distance=20, bias=False, tie_embeddings=True, attention_scale=1.0,
               output_scale=32**-0.5),
    "bart": dict(**_ENC_DEC, norm="layer", norm_position="post", ffn="gelu", position="learned", position_offset=2,
                 embedding_norm=True, bias=True, head_bias=True, tie_embeddings=True),
    "marian": dict(**{**_ENC_DEC, "scale_embeddings": True}, norm="layer", norm_position="post", ffn="silu",
                   position="sinusoidal", sinusoid_layout="split", bias=True, head_bias=True, tie_embeddings=True),
}
FIELDS = dataclasses.fields(TransformerConfig)
HINTS = typing.get_type_hints(TransformerConfig)
PER_FIELD = 2
# Fields that can differ from their default only once another field does, which every family
# refuses first: their cases are that field's.
NEEDS_ANOTHER = {"cls_token": "input"}  # constructible non-default values tried per field and family


def candidates(name: str, current):
    """Values of field ``name`` other than ``current``, from its type alone."""
    hint = HINTS[name]
    kind = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        kind = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        return [v for v in typing.get_args(kind) if v != current]
    if kind is bool:
        return [not current] if current is not None else [True, False]
    if kind is int:
        pool = [1, 2, 4, 8, 16] if current is None else [current + 1, current * 2, max(1, current // 2), current + 8]
        return [v for v in dict.fromkeys(pool) if v != current]
    if kind is float:
        pool = [0.5, 2.0] if current is None else [current * 2, current / 2, 0.5]
        return [v for v in dict.fromkeys(pool) if v != current]
    raise AssertionError(f"TransformerConfig.{name}: no case generator for type {hint}; add one here")


def variants(family: str, name: str):
    """Up to PER_FIELD valid configs that differ from the family's base in ``name``."""
    base = TransformerConfig(**BASES[family])
    out = []
    for value in candidates(name, getattr(base, name)):
        try:  # built as a user would write it: fields the base leaves out are derived again
            cfg = TransformerConfig(**{**BASES[family], name: value})
            build_model(cfg)  # an input adapter checks its own combination of fields
        except (TypeError, ValueError):
            continue  # this value needs other fields changed too
        if getattr(cfg, name) != getattr(base, name):
            out.append((value, cfg))
        if len(out) == PER_FIELD:
            break
    return out


def _model(cfg: TransformerConfig):
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        src = getattr(model, "src_embed", None)
        tgt = getattr(model, "tgt_embed", None)
        if hasattr(src, "tokens") and src.tokens.weight is not tgt.tokens.weight and src.tokens.weight.shape == tgt.tokens.weight.shape:
            src.tokens.weight.copy_(model.tgt_embed.tokens.weight)  # one shared matrix in every HF seq2seq family
    return model


def _outputs_agree(model, out_dir) -> float:
    """The largest difference between blockformer's outputs and transformers' on the export."""
    import json

    arch = json.loads((out_dir / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, arch).from_pretrained(out_dir).eval()
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    with torch.no_grad():
        if cfg.arch == "encoder-decoder":
            tgt = torch.randint(0, cfg.vocab_size, (B, T - 2), generator=g)
            return (hf(input_ids=ids, decoder_input_ids=tgt).logits - model(ids, tgt)).abs().max().item()
        if cfg.arch == "decoder":
            return (hf(ids).logits - model(ids)).abs().max().item()
        out = hf(ids, output_hidden_states=True)
        hidden = model.hidden_states(ids)
        diff = (out.hidden_states[-1] - hidden).abs().max().item()
        if cfg.head_transform:
            logits = out.logits if hasattr(out, "logits") else out.prediction_logits  # BertForPreTraining
            diff = max(diff, (logits - model(ids)).abs().max().item())
        if cfg.pooler:
            diff = max(diff, (hf.base_model(ids).pooler_output - model.pool(hidden)).abs().max().item())
        return diff


@pytest.mark.parametrize("family", list(BASES))
def test_the_family_base_exports_with_equal_outputs(family, tmp_path):
    model = _model(TransformerConfig(**BASES[family]))
    out = to_hf(model, tmp_path / "out")
    assert _outputs_agree(model, out) <= ATOL


@pytest.mark.slow
@pytest.mark.parametrize("family", list(BASES))
def test_every_field_exports_exactly_or_is_refused_naming_it(family, tmp_path):
    exported, refused, wrong = [], [], []
    for f in FIELDS:
        for value, cfg in variants(family, f.name):
            model = _model(cfg)
            out = tmp_path / f"{f.name}-{len(exported) + len(refused)}"
            try:
                to_hf(model, out)
            except UsageError as e:
                msg = str(e)
                # arch/position pick another family, whose first check may name another field
                names_it = f.name in msg or (f.name in ("arch", "position") and msg.startswith("model"))
                if "\n" in msg or not names_it:
                    wrong.append(f"{f.name}={value!r}: refused without naming it: {msg}")
                refused.append(f.name)
                continue
            diff = _outputs_agree(model, out)
            if not diff <= ATOL:
                wrong.append(f"{f.name}={value!r}: exported, but transformers differs by {diff:.3g}")
            exported.append(f.name)
    assert not wrong, "\n".join(wrong)
    assert exported and refused  # both paths ran
    if family == "llama":  # the newer options that once exported silently wrong
        assert {"ffn_experts", "output_scale"} <= set(refused)
        assert {"attention_window", "rope_scaling", "rope_scaling_factor", "n_kv_heads"} <= set(exported)


def test_every_field_gets_cases_and_every_family_names_real_fields():
    """A field no family base can vary (so no case would test it) fails here, as does a
    family that maps or fixes a field that does not exist (a typo would let it through)."""
    names = {f.name for f in FIELDS}
    untested = [n for n in names if not any(variants(fam, n) for fam in BASES) and n not in NEEDS_ANOTHER]
    assert not untested, f"no constructible non-default value on any family base: {untested}"
    for fam in _FAMILIES:
        assert set(fam.mapped) <= names and set(fam.fixed) <= names and set(fam.signature) <= names, fam.name
    assert TRAINING_ONLY <= names


def test_an_moe_model_is_refused_in_one_line():
    cfg = TransformerConfig(**{**BASES["llama"], "ffn_experts": 4, "experts_top_k": 2})
    with pytest.raises(UsageError, match=r"^model\.ffn_experts=4 has no counterpart in Hugging Face llama"):
        to_hf(build_model(cfg), "unused-out")
