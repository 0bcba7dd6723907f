"""The registry: one small module per Hugging Face family, keyed by ``model_type``.

A family says how a Hugging Face ``config.json`` maps to a ``TransformerConfig`` and back,
which blockformer configs it can express (``mapped``: fields it writes, whatever their
value; ``fixed``: field -> allowed values; every other field must be at its neutral value,
or the export is refused naming it), and its key map (``rules``).
"""

from __future__ import annotations

from typing import Any

from ...config import TransformerConfig
from ...errors import UsageError
from .base import (  # noqa: F401 - the shared helpers, still importable from here
    ACTIVATIONS,
    SHAPE,
    TRAINING_ONLY,
    Family,
    HasTensor,
    activation_from_hf,
    activation_to_hf,
    equal_or_refuse,
    flag,
    generation_config,
    integer,
    mapping,
    need,
    neutral_value,
    number,
    refuse,
    text,
)
from . import bart, bert, gpt2, llama, t5  # each family module reads the helpers from .base


_FAMILIES = [gpt2.FAMILY, llama.FAMILY, bert.FAMILY, t5.FAMILY, bart.BART, bart.MARIAN]


def _registry() -> dict[str, Family]:
    return {t: f for f in _FAMILIES for t in f.model_types}


def family_for_model_type(model_type: Any, where: str) -> Family:
    registry = _registry()
    if not isinstance(model_type, str) or model_type not in registry:
        raise UsageError(
            f"{where}: model_type={model_type!r} is not supported; expected one of {', '.join(sorted(registry))}"
        )
    return registry[model_type]


def family_for_config(cfg: TransformerConfig) -> Family:
    """The family a blockformer config exports to, by its signature fields."""
    seen: dict[str, Family] = {}
    for fam in _registry().values():
        seen[fam.name] = fam
    for fam in seen.values():
        if all(getattr(cfg, k) in v for k, v in fam.signature.items()):
            return fam
    shapes = "; ".join(
        f"{f.name}: " + ", ".join(f"{k}={'|'.join(map(str, v))}" for k, v in f.signature.items()) for f in seen.values()
    )
    raise UsageError(
        f"model: arch={cfg.arch!r}, position={cfg.position!r}, norm={cfg.norm!r}, norm_position="
        f"{cfg.norm_position!r}, ffn={cfg.ffn!r} matches no Hugging Face family; expected one of: {shapes}"
    )
