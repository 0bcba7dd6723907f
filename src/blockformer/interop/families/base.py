"""What every family module shares: the ``Family`` record, the fields no family expresses
(``NEUTRAL``), and the readers of Hugging Face ``config.json`` values that name the key and
the file when a value is wrong. A leaf of the package: the family modules and the registry
(``families/__init__.py``) import it, it imports neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ...config import TransformerConfig
from ...errors import UsageError
from ..rules import Rule

HasTensor = Callable[[str], bool]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    signature: dict[str, Any]  # export: the fields that pick this family (arch, position, norm)
    fixed: dict[str, tuple]  # export: field -> the values this family can express
    config_from_hf: Callable[[dict, HasTensor, str], TransformerConfig]  # (hf config, has, where)
    config_to_hf: Callable[[TransformerConfig, dict[str, int]], dict]  # (config, hf special ids)
    rules: Callable[[TransformerConfig], list[Rule]]
    prefix: str = ""  # the base model's prefix in the task-model layout (``transformer.``)
    outside: tuple[str, ...] = ()  # names outside the prefix (heads)
    ignore: Callable[[TransformerConfig], list[str]] = lambda cfg: []  # regexes import may skip
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> older spellings
    extra: Callable[[TransformerConfig], dict] = lambda cfg: {}  # export: tensors HF needs that we lack

    def check_exportable(self, cfg: TransformerConfig) -> None:
        for name, allowed in self.fixed.items():
            value = getattr(cfg, name)
            if value not in allowed:
                want = " or ".join(repr(a) for a in allowed)
                raise UsageError(
                    f"model.{name}={value!r} has no counterpart in Hugging Face {self.name}; expected {want}"
                )


# Fields no family expresses unless it says otherwise: the blockformer-only experiments.
NEUTRAL: dict[str, tuple] = {
    "residual": ("plain",),
    "norm_bias": (True,),
    "rope_interleaved": (False,),
    "sinusoid_layout": ("interleaved",),
    "position_offset": (0,),
    "n_token_types": (0,),
    "embedding_norm": (False,),
    "head_transform": (False,),
    "head_bias": (False,),
    "output_scale": (1.0,),
    "pooler": (False,),
    "attention_scale": (None,),
    "src_vocab_size": (None,),
}


def neutral(*free: str) -> dict[str, tuple]:
    """``NEUTRAL`` without the fields a family expresses freely."""
    return {k: v for k, v in NEUTRAL.items() if k not in free}


_ABSENT = object()


def need(hf: dict, key: str, where: str) -> int:
    """A required size or count: an integer >= 1."""
    return integer(hf, key, where)


def integer(hf: dict, key: str, where: str, default: Any = _ABSENT, minimum: int = 1) -> Any:
    """``hf[key]`` as an integer >= ``minimum``; ``default`` when it is absent or null
    (without a default, it must be there)."""
    if hf.get(key) is None:
        return _default(key, where, default)
    value = hf[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UsageError(f"{where}: {key}={value!r}; expected an integer >= {minimum}")
    return value


def number(hf: dict, key: str, where: str, default: float) -> float:
    """``hf[key]`` as a finite real number; ``default`` when absent or null."""
    value = hf[key] if hf.get(key) is not None else default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise UsageError(f"{where}: {key}={value!r}; expected a number")
    return float(value)


def flag(hf: dict, key: str, where: str, default: bool) -> bool:
    """``hf[key]`` as true or false; ``default`` when absent or null."""
    value = hf[key] if hf.get(key) is not None else default
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key}={value!r}; expected true or false")
    return value


def text(hf: dict, key: str, where: str, default: str) -> str:
    """``hf[key]`` as a string; ``default`` when absent or null."""
    value = hf[key] if hf.get(key) is not None else default
    if not isinstance(value, str):
        raise UsageError(f"{where}: {key}={value!r}; expected a string")
    return value


def mapping(hf: dict, key: str, where: str) -> dict:
    """``hf[key]`` as a JSON object; empty when absent or null."""
    value = hf[key] if hf.get(key) is not None else {}
    if not isinstance(value, dict):
        raise UsageError(f"{where}: {key}={value!r}; expected a JSON object (or null)")
    return value


def _default(key: str, where: str, default: Any) -> Any:
    if default is _ABSENT:
        raise UsageError(f"{where}: missing {key!r}; expected it in a Hugging Face config.json")
    return default


def refuse(where: str, key: str, value: Any, why: str) -> UsageError:
    return UsageError(f"{where}: {key}={value!r} is not supported ({why})")


def equal_or_refuse(hf: dict, a: str, b: str, where: str) -> None:
    if b in hf and hf.get(b) is not None and hf[b] != hf.get(a):
        raise refuse(where, b, hf[b], f"blockformer uses one value for {a} and {b}")


ACTIVATIONS = {  # Hugging Face activation name -> (ffn, gelu_approximate)
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", "none"),
    "silu": ("silu", "none"),
    "swish": ("silu", "none"),
}


def activation_from_hf(name: Any, key: str, where: str) -> tuple[str, str]:
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise refuse(where, key, name, f"expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def activation_to_hf(cfg: TransformerConfig) -> str:
    base = {"gelu": "gelu", "geglu": "gelu", "relu": "relu", "silu": "silu", "swiglu": "silu"}[cfg.ffn]
    return "gelu_new" if base == "gelu" and cfg.gelu_approximate == "tanh" else base
