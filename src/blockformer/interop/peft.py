"""LoRA adapters in PEFT's format, both ways: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT names an adapter by the Hugging Face module it adapts
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, A (r, in), B (out, r),
update ``scale * B A`` with ``scale = lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``);
the module names come from the family key maps (``families/``), the same rules that move the
base weights, so q/k rows under ``rope_interleaved`` are permuted exactly as the base's are.

- Fused q/k/v (Llama, BERT): blockformer's adapter on the fused ``qkv`` is one A (r, in) and
  one B (q + 2 kv, r). Export splits B by rows and repeats A for q, k and v; this is exact,
  since ``B A`` restricted to q's rows is ``B_q A``. Import stacks PEFT's three As and makes B
  block-diagonal, so the fused rank is ``r_q + r_k + r_v`` (3r) unless the three As are equal
  (then it stays r): the rank grows there, and ``from_peft`` says so in its ``notes``.
- GPT-2's ``c_attn`` is fused in Hugging Face too (``Conv1D``, ``fan_in_fan_out=True``): one
  adapter each way, with PEFT's A and B in ``nn.Linear``'s orientation (nothing transposed).
- A gated FFN's ``gate`` and ``up`` halves are two adapters already: ``gate_proj``, ``up_proj``.
- Adapters touch only projections between hidden sizes, never rows indexed by token id, so
  the vocabulary permutation of ``from_hf`` (``vocab.py``) does not apply; PEFT adapters on
  embeddings or the LM head are refused, as are DoRA, trained biases and ``modules_to_save``
  (a task head). ``lora_dropout`` is carried.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from ..errors import UsageError
from ..models.checks import kind_of
from ..models.heads import TaskModel
from ..nn.lora import LORA_TARGETS, LoRALinear, lora_layers, lora_parts
from .convert import Imported, check_target, from_hf
from .families import Family, family_for_config
from .hf_dir import read_json_object, staged
from .rules import Rule

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's wrapper around the Hugging Face model
FAMILIES = ("gpt2", "llama", "bert")  # the families whose adapters map both ways
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# adapter_config.json fields blockformer's LoRA has no counterpart for: each must be off.
_OFF = ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "target_parameters",
        "layer_replication", "use_qalora", "use_bdlora", "alora_invocation_tokens")


@dataclass
class ImportedAdapter(Imported):
    """``from_hf``'s result with a PEFT adapter on it: ``model`` carries ``LoRALinear`` layers
    (unmerged; ``nn.lora.unload_lora`` merges them); ``notes`` says where the rank grew."""

    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Place:
    """Where a Hugging Face module sits in blockformer: the fused linear, its rule, and the
    index of this module among the rule's ``theirs``."""

    ours: str  # blockformer module name, e.g. decoder.blocks.0.attn.qkv
    rule: Rule
    index: int


def _places(model: nn.Module, family: Family) -> dict[str, _Place]:
    """Hugging Face module name -> its place, for every projection blockformer can adapt."""
    cfg = model.cfg
    adaptable = set()
    for name, module in model.named_modules():
        for child in lora_parts(module, list(LORA_TARGETS)):
            adaptable.add(f"{name}.{child}" if name else child)
    out = {}
    for rule in family.rules(cfg):
        ours = rule.ours.removesuffix(".weight")
        if rule.ours.endswith(".weight") and ours in adaptable:
            for i, theirs in enumerate(rule.theirs):
                out[theirs.removesuffix(".weight")] = _Place(ours, dataclasses.replace(rule, transpose=False), i)
    return out


def _row_ranges(rule: Rule, rows: int) -> list[tuple[int, int]]:
    """The (first, end) rows of each of ``rule.theirs`` within the fused matrix."""
    sizes = list(rule.sizes) if len(rule.theirs) > 1 else [rows]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def _covered(rule: Rule, rows: int, start: int, stop: int) -> list[int]:
    """The indices of ``rule.theirs`` lying inside rows [start, stop), which they must tile."""
    inside = [i for i, (s, e) in enumerate(_row_ranges(rule, rows)) if start <= s and e <= stop]
    if sum(e - s for s, e in (_row_ranges(rule, rows)[i] for i in inside)) != stop - start:
        raise RuntimeError(f"{rule.ours}: rows {start}:{stop} are not whole Hugging Face modules")
    return inside


def _family(model: nn.Module) -> Family:
    family = family_for_config(model.cfg)
    if family.name not in FAMILIES:
        raise UsageError(f"model: a Hugging Face {family.name} model; PEFT adapters map for "
                         f"{', '.join(FAMILIES)} only")
    return family


# ---------------------------------------------------------------------- export
def to_peft(source: str | Path | nn.Module, out: str | Path, *, base_model_name_or_path: str | None = None,
            overwrite: bool = False) -> Path:
    """Write the LoRA adapters of a blockformer LoRA checkpoint (or of a model carrying
    ``LoRALinear`` layers) as a PEFT adapter directory that ``peft.PeftModel.from_pretrained``
    loads onto the Hugging Face export of its base (``to_hf``).

    ``base_model_name_or_path`` goes into ``adapter_config.json``; by default, the base
    checkpoint the adapter names. ``out`` must be new or empty (or, with ``overwrite``, is
    replaced whole)."""
    if not isinstance(source, (str, Path)) and not isinstance(source, nn.Module):
        raise TypeError(f"source: {kind_of(source)}; expected a blockformer LoRA checkpoint directory or model")
    if not isinstance(out, (str, Path)):
        raise TypeError(f"out: {kind_of(out)}; expected a directory path")
    check_target(Path(out), None if isinstance(source, nn.Module) else Path(source), overwrite=overwrite)
    if isinstance(source, nn.Module):
        model = source
    else:
        model, base = _load_unmerged(Path(source))
        base_model_name_or_path = base_model_name_or_path or base
    if isinstance(model, TaskModel):
        raise UsageError("head.task: a task head has no place in a PEFT LoRA adapter (PEFT keeps it in "
                         "modules_to_save, outside the adapter); expected a language-model LoRA run")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not layers:
        raise UsageError("model: no LoRA adapters (lora.rank = 0); expected a model or checkpoint of a LoRA run")
    family = _family(model)
    family.check_exportable(model.cfg)
    places = _places(model, family)
    by_ours: dict[str, list[tuple[str, _Place]]] = {}
    for theirs, place in places.items():
        by_ours.setdefault(place.ours, []).append((theirs, place))
    rslora = {m.rslora for m in layers.values()}
    rslora = rslora.pop() if len(rslora) == 1 else False  # mixed: every scale written as alpha / r
    tensors, ranks, alphas = {}, {}, {}
    with torch.no_grad():
        for name, layer in layers.items():
            if name not in by_ours:
                raise UsageError(f"model: an adapter on {name} has no Hugging Face {family.name} module to map to")
            rule = by_ours[name][0][1].rule
            theirs = [t for t, _ in sorted(by_ours[name], key=lambda tp: tp[1].index)]
            for part, (start, stop) in layer.parts.items():
                a, b = layer.lora_A[part].detach().float().cpu(), layer.lora_B[part].detach().float().cpu()
                full = torch.zeros(layer.out_features, b.shape[1])
                full[start:stop] = b
                pieces = rule.to_theirs(full, model.cfg.rope_interleaved)  # split q/k/v, rope rows permuted
                for i in _covered(rule, layer.out_features, start, stop):
                    tensors[f"{PREFIX}{theirs[i]}.lora_A.weight"] = a.clone()  # the same A for each: exact
                    tensors[f"{PREFIX}{theirs[i]}.lora_B.weight"] = pieces[i]
                    ranks[theirs[i]] = r = a.shape[0]
                    alphas[theirs[i]] = _peft_alpha(layer, r, rslora)
    dropout = max(m.lora_dropout.p for m in layers.values())
    config = _adapter_config(model, family, places, ranks, alphas, rslora, dropout, base_model_name_or_path)
    out = Path(out)
    _write_dir(out, {ADAPTER_CONFIG: json.dumps(config, indent=2) + "\n"}, tensors)
    return out


def _peft_alpha(layer: LoRALinear, r: int, rslora: bool) -> float:
    """The ``lora_alpha`` that gives a PEFT module of rank ``r`` this layer's scale: the layer's
    own alpha when its rank and rule are PEFT's, else solved from the scale."""
    if r == layer.rank and layer.rslora == rslora and layer.scale == layer.alpha / (math.sqrt(r) if rslora else r):
        return layer.alpha
    return layer.scale * (math.sqrt(r) if rslora else r)


def _alpha_fields(alphas: dict[str, float]) -> tuple[float, dict[str, float]]:
    """``lora_alpha`` (the most common) and ``alpha_pattern`` for the modules that differ."""
    common = Counter(alphas.values()).most_common(1)[0][0]
    return common, {re.escape(t): a for t, a in sorted(alphas.items()) if a != common}


def _adapter_config(model: nn.Module, family: Family, places: dict[str, _Place], ranks: dict[str, int],
                    alphas: dict[str, float], rslora: bool, dropout: float, base: str | None) -> dict[str, Any]:
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha, alpha_pattern = _alpha_fields(alphas)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if model.cfg.arch == "decoder" else None,
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "lora_dropout": dropout,
        "target_modules": _target_pattern(set(ranks), set(places)),
        "rank_pattern": {re.escape(t): k for t, k in sorted(ranks.items()) if k != r},
        "alpha_pattern": alpha_pattern,
        "fan_in_fan_out": family.name == "gpt2",  # Conv1D stores (in, out)
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _target_pattern(adapted: set[str], adaptable: set[str]) -> str:
    """A regex PEFT full-matches against module names: per layer kind when every layer is
    adapted (``model\\.layers\\.\\d+\\.self_attn\\.q_proj``), else every name spelled out.
    A list of suffixes would be ambiguous (BERT's ``output.dense`` ends
    ``attention.output.dense`` too)."""
    kinds = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in adapted})
    general = "|".join(kinds)
    if {m for m in adaptable if re.fullmatch(general, m)} == adapted:
        return f"(?:{general})"
    return "(?:" + "|".join(re.escape(m) for m in sorted(adapted)) + ")"


def _load_unmerged(path: Path) -> tuple[nn.Module, str]:
    """A LoRA checkpoint's model with its adapters unmerged, and its base checkpoint's path."""
    from ..train.adapter import ADAPTER, read_adapter_base  # noqa: PLC0415
    from ..train.build import build_run_model  # noqa: PLC0415
    from ..train.checkpoint import resolve_checkpoint  # noqa: PLC0415
    from ..train.load import load_weights, read_config  # noqa: PLC0415

    path = resolve_checkpoint(path)
    if not (path / ADAPTER).is_file():
        raise UsageError(f"{path}: no {ADAPTER}; expected a checkpoint of a LoRA run (lora.rank > 0)")
    config = read_config(path)
    if config.head.task != "none":
        raise UsageError(f"{path}: head.task={config.head.task!r}: a task head has no place in a PEFT LoRA "
                         f"adapter; expected a language-model LoRA run")
    model = build_run_model(config)
    load_weights(model, path)
    return model.eval(), read_adapter_base(path)


def _write_dir(out: Path, files: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    """``out`` written whole beside itself and renamed into place (replacing what was there)."""
    with staged(out) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                                    metadata={"format": "pt"})


# ---------------------------------------------------------------------- import
def read_adapter_config(directory: Path) -> dict[str, Any]:
    """A PEFT ``adapter_config.json``, refused (naming the field) where blockformer's LoRA
    has no counterpart."""
    file = directory / ADAPTER_CONFIG
    cfg = read_json_object(directory, ADAPTER_CONFIG, f"a PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    if cfg.get("peft_type") != "LORA":
        raise UsageError(f"{file}: peft_type={cfg.get('peft_type')!r}; expected 'LORA'")
    for key in _OFF:
        if cfg.get(key):
            raise UsageError(f"{file}: {key}={cfg[key]!r} is not supported (blockformer's LoRA has no counterpart); "
                             f"expected it off")
    if cfg.get("bias", "none") != "none":
        raise UsageError(f"{file}: bias={cfg['bias']!r} is not supported (trained biases); expected 'none'")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise UsageError(f"{file}: lora_alpha={alpha!r}; expected a number > 0")
    for key in ("alpha_pattern", "rank_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise UsageError(f"{file}: {key}={cfg[key]!r}; expected a JSON object")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise UsageError(f"{file}: use_rslora={cfg['use_rslora']!r}; expected true or false")
    dropout = cfg.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UsageError(f"{file}: lora_dropout={dropout!r}; expected a number in [0, 1)")
    return cfg


def _alpha_of(cfg: dict[str, Any], module: str) -> float:
    """PEFT's alpha for one module: the first ``alpha_pattern`` key that ends its name, else ``lora_alpha``."""
    for key, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return float(cfg.get("lora_alpha", 8))


def _read_adapter_tensors(directory: Path, cfg: dict[str, Any], places: dict[str, _Place], family: Family,
                          in_features: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
    """``{Hugging Face module: {"A": A, "B": B}}`` of ``adapter_model.safetensors``, each key checked."""
    file = directory / ADAPTER_WEIGHTS
    if not file.is_file():
        other = " (PEFT's older adapter_model.bin: re-save it with save_pretrained, which writes safetensors)" \
            if (directory / "adapter_model.bin").is_file() else ""
        raise UsageError(f"{file}: not found{other}; expected the adapter's weights beside {ADAPTER_CONFIG}")
    try:
        tensors = safetensors.torch.load_file(str(file))
    except (safetensors.SafetensorError, OSError) as e:
        raise UsageError(f"{file}: cannot read the adapter ({str(e).strip().splitlines()[0]})") from None
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise UsageError(f"{file}: tensor {key!r} is not a LoRA A or B matrix (embedding adapters, DoRA "
                             f"magnitudes and saved modules are not supported); expected *.lora_A.weight/*.lora_B.weight")
        module = m["module"]
        if module not in places and family.prefix + module in places:  # an adapter on the bare model (GPT2Model)
            module = family.prefix + module
        if module not in places:
            kinds = sorted({re.sub(r"^.*\.\d+\.", "", p) for p in places})
            raise UsageError(f"{file}: tensor {key!r} adapts {m['module']!r}, which is no projection of this "
                             f"{family.name} model blockformer adapts (adapter_config.json target_modules="
                             f"{cfg.get('target_modules')!r}); expected {', '.join(kinds)}")
        found.setdefault(module, {})[m["ab"]] = t.float()
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise UsageError(f"{file}: {module} has lora_{next(iter(ab))} but no lora_{'B' if 'A' in ab else 'A'}")
        a, b, n_in = ab["A"], ab["B"], in_features[places[module].ours]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[1] != n_in:
            raise UsageError(f"{file}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; expected "
                             f"A (r, {n_in}) and B (out, r) for this base (is the adapter for another model?)")
    if not found:
        raise UsageError(f"{file}: holds no adapter tensors")
    return found


def from_peft(adapter: str | Path, base: str | Path | Imported) -> ImportedAdapter:
    """A PEFT LoRA adapter directory on a blockformer model imported from its Hugging Face
    base (a directory, or ``from_hf``'s result, which is adapted in place).

    Separate q/k/v adapters become one adapter on the fused ``qkv``: A stacked, B
    block-diagonal, so its rank is the sum of theirs (3r for q, k, v) unless their As are
    equal (then r); ``notes`` names the layers where the rank grew. Logits equal PEFT's
    (the fused update is exactly theirs)."""
    if not isinstance(adapter, (str, Path)):
        raise TypeError(f"adapter: {kind_of(adapter)}; expected a PEFT adapter directory")
    directory = Path(adapter)
    cfg = read_adapter_config(directory)
    imported = base if isinstance(base, Imported) else from_hf(base)
    model = imported.model
    if isinstance(model, TaskModel):
        raise UsageError(f"{base if not isinstance(base, Imported) else 'base'}: a model with a task head; PEFT "
                         f"adapters map onto the language models of {', '.join(FAMILIES)} here")
    if lora_layers(model):
        raise UsageError("base: already carries LoRA adapters; expected a model as from_hf imports it")
    family = _family(model)
    places = _places(model, family)
    in_features = {p.ours: model.get_submodule(p.ours).in_features for p in places.values()}
    found = _read_adapter_tensors(directory, cfg, places, family, in_features)
    rslora, dropout = bool(cfg.get("use_rslora", False)), float(cfg.get("lora_dropout", 0.0))
    grown: list[str] = []
    by_ours: dict[str, list[tuple[str, _Place]]] = {}
    for theirs, place in places.items():
        by_ours.setdefault(place.ours, []).append((theirs, place))
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        for ours, members in by_ours.items():
            members = sorted(members, key=lambda tp: tp[1].index)
            if not any(t in found for t, _ in members):
                continue
            parent_name, _, child = ours.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child)
            rule = members[0][1].rule
            layer_parts, adapters, scale = {}, {}, None
            for part, (start, stop) in lora_parts(parent, list(LORA_TARGETS))[child].items():
                inside = _covered(rule, linear.out_features, start, stop)
                present = [i for i in inside if members[i][0] in found]
                if not present:
                    continue
                ab = [found[members[i][0]] for i in present]
                scales = [_alpha_of(cfg, members[i][0]) / (math.sqrt(x["A"].shape[0]) if rslora else x["A"].shape[0])
                          for i, x in zip(present, ab)]
                scale = scales[0] if scale is None else scale
                a, b = _fuse(rule, linear.out_features, start, stop, present, ab, [s / scale for s in scales],
                             model.cfg.rope_interleaved)
                if a.shape[0] > ab[0]["A"].shape[0]:
                    grown.append(f"{ours} ({', '.join(members[i][0].rsplit('.', 1)[-1] for i in present)}: "
                                 f"rank {ab[0]['A'].shape[0]} -> {a.shape[0]})")
                layer_parts[part], adapters[part] = (start, stop), (a, b)
            rank = max(a.shape[0] for a, _ in adapters.values())
            layer = LoRALinear(linear, layer_parts, rank, scale * (math.sqrt(rank) if rslora else rank), rslora, dropout)
            layer.scale = scale  # exactly PEFT's, not recomputed through the grown rank
            for part, (a, b) in adapters.items():
                layer.lora_A[part] = nn.Parameter(a.to(linear.weight))
                layer.lora_B[part] = nn.Parameter(b.to(linear.weight))
            setattr(parent, child, layer)
    notes = []
    if grown:
        notes.append(f"the fused qkv adapter's rank grows where PEFT's q/k/v lora_A differ (A stacked, B "
                     f"block-diagonal: exact) in {len(grown)} layer(s): {grown[0]}{', ...' if len(grown) > 1 else ''}")
    fields = {f.name: getattr(imported, f.name) for f in dataclasses.fields(Imported)}
    return ImportedAdapter(**{**fields, "model": model.eval()}, notes=notes)


def _fuse(rule: Rule, rows: int, start: int, stop: int, present: list[int], ab: list[dict[str, torch.Tensor]],
          ratios: list[float], rope_interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter (A, B) on rows [start, stop) from PEFT's adapters on the modules ``present``:
    the As shared when equal, else stacked with B block-diagonal. ``ratios`` folds a module
    whose scale differs from the layer's into its B."""
    shared = all(torch.equal(x["A"], ab[0]["A"]) for x in ab)
    a = ab[0]["A"] if shared else torch.cat([x["A"] for x in ab])
    ranges = _row_ranges(rule, rows)
    pieces = [torch.zeros(e - s, a.shape[0]) for s, e in ranges]
    col = 0
    for i, x, ratio in zip(present, ab, ratios):
        r = x["A"].shape[0]
        if tuple(x["B"].shape) != (len(pieces[i]), r):
            raise UsageError(f"{rule.theirs[i].removesuffix('.weight')}: lora_B {tuple(x['B'].shape)}; expected "
                             f"({len(pieces[i])}, {r}) for this base (is the adapter for another model?)")
        cols = slice(0, r) if shared else slice(col, col + r)
        pieces[i][:, cols] = x["B"] * ratio
        col += r
    full = rule.to_ours(pieces, rope_interleaved)  # q/k rows into blockformer's rope layout
    return a.clone(), full[start:stop].clone()
