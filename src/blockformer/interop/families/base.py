"""What every family module shares: the ``Family`` record and its export check (every
``TransformerConfig`` field mapped by the family, held to values it can express, or at its
neutral value), and the readers of Hugging Face ``config.json`` values that name the key and
the file when a value is wrong. A leaf of the package: the family modules and the registry
(``families/__init__.py``) import it, it imports neither.
"""

from __future__ import annotations

import dataclasses
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
    mapped: tuple[str, ...]  # export: fields config_to_hf writes, whatever their value
    fixed: dict[str, tuple]  # export: field -> the values this family can express
    config_from_hf: Callable[[dict, HasTensor, str], TransformerConfig]  # (hf config, has, where)
    config_to_hf: Callable[[TransformerConfig, dict[str, int]], dict]  # (config, hf special ids)
    rules: Callable[[TransformerConfig], list[Rule]]
    prefix: str = ""  # the base model's prefix in the task-model layout (``transformer.``)
    outside: tuple[str, ...] = ()  # names outside the prefix (heads)
    ignore: Callable[[TransformerConfig], list[str]] = lambda cfg: []  # regexes import may skip
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> older spellings
    extra: Callable[[TransformerConfig], dict] = lambda cfg: {}  # export: tensors HF needs that we lack
    check: Callable[[TransformerConfig], None] = lambda cfg: None  # export: constraints across fields

    def check_exportable(self, cfg: TransformerConfig) -> None:
        """Every field of the config, in order: a ``fixed`` one must hold a value the family
        can express, a ``mapped`` (or training-only) one may be anything, and every other one,
        including fields added to ``TransformerConfig`` after this family was written, must be
        at its neutral value. So nothing the family would silently drop gets exported."""
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if f.name in self.fixed:
                allowed = self.fixed[f.name]
                if value not in allowed:
                    want = " or ".join(repr(a) for a in allowed)
                    raise UsageError(f"model.{f.name}={value!r} has no counterpart in Hugging Face {self.name}; "
                                     f"expected {want}")
            elif f.name not in self.mapped and f.name not in TRAINING_ONLY:
                neutral = neutral_value(cfg, f.name)
                if value != neutral:
                    raise UsageError(f"model.{f.name}={value!r} has no counterpart in Hugging Face {self.name}; "
                                     f"expected {neutral!r} (its default, which {self.name} computes)")
        self.check(cfg)


# The fields every family writes into its config.json: which family, and the sizes.
SHAPE = ("arch", "position", "vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "norm_eps")

# Fields that shape training only (initialisation, dropout, auxiliary losses): a trained
# model computes the same outputs whatever they are, so every family exports them.
TRAINING_ONLY = frozenset({"dropout", "attention_dropout", "init_std", "residual_gate_init", "router_aux_coef",
                           "router_z_coef", "expert_capacity_factor"})


def neutral_value(cfg: TransformerConfig, name: str) -> Any:
    """What ``cfg.name`` would be had it been left at its default (a derived field such as
    ``n_kv_heads`` derives it from the rest of ``cfg``: ``n_heads``)."""
    f = next(f for f in dataclasses.fields(cfg) if f.name == name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    try:
        return getattr(dataclasses.replace(cfg, **{name: default}), name)
    except (TypeError, ValueError):  # the rest of cfg needs this field set: the plain default
        return default


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


def generation_config(cfg: TransformerConfig, hf_config: dict) -> dict:
    """``generation_config.json``: what ``generate()`` in transformers reads by default, set
    so that it decodes as blockformer does: greedy, the config's special ids, an
    encoder-decoder's target started from the token blockformer trains it from (bos), never
    a forced eos, and at most ``max_length`` target tokens counting the start (the position
    table's length)."""
    out = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
           if k in hf_config}
    if cfg.arch == "encoder-decoder":
        out["max_length"] = cfg.max_seq_len
    return {**out, "do_sample": False, "num_beams": 1}
