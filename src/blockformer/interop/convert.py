"""Hugging Face directory <-> blockformer model, through a family's key map.

Import: read ``config.json`` -> family (by ``model_type``) -> ``TransformerConfig`` ->
build the model -> fill every parameter from its rule, checking names and shapes; a tensor
that is missing, misshapen or has no place in the map is an error naming file and key.
Export: the checkpoint's config -> the family whose signature it has (every other field
checked against what the family can express) -> tensors by the same rules, reversed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..config import TransformerConfig
from ..errors import UsageError
from ..models import build_model
from ..models.heads import TaskModel
from ..run_config import HeadConfig
from ..tokenizers.base import FILE_NAME, Tokenizer
from ..tokenizers.bpe import BPETokenizer
from .families import Family, family_for_config, family_for_model_type, generation_config
from .heads import export_head, import_head, task_tokenizer_json
from .hf_dir import CONFIG, DEFAULT_MAX_SHARD_SIZE, HFWeights, parse_size, read_hf_config, write_hf_dir
from .hub import model_card, resolve_source
from .rules import Rule
from .vocab import VocabMap, hf_special_ids, import_tokenizer, token_roles
from ..models.checks import kind_of
from ..train.checkpoint import step_checkpoints
from ..train.load import load_checkpoint


@dataclass
class Imported:
    """A converted model (eval mode), its tokenizer (None when the source had no
    ``tokenizer.json``: ids are then the source's own) and the Hugging Face family."""

    model: nn.Module
    tokenizer: BPETokenizer | None
    config: TransformerConfig
    family: str
    vocab: VocabMap
    head: HeadConfig | None = None  # a task head's [head] section (BertForSequenceClassification, ...)


class _StateDict:
    """An in-memory state dict read like a directory (``from_hf`` given a model object)."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str, outside: tuple[str, ...], where: str) -> None:
        self.where = Path(where)
        self._t = {(k if not prefix or k.startswith(prefix) or k.startswith(outside) else prefix + k): v
                   for k, v in state.items()}

    def names(self) -> set[str]:
        return set(self._t)

    def has(self, name: str) -> bool:
        return name in self._t

    def file_of(self, name: str) -> Path:
        return self.where

    def name_in_file(self, name: str) -> str:
        return name

    def get(self, name: str) -> torch.Tensor:
        if name not in self._t:
            raise UsageError(f"{self.where}: missing tensor {name!r}")
        return self._t[name]


def from_hf(source: str | Path | nn.Module, *, tokenizer: str | Path | None = None) -> Imported:
    """A Hugging Face model directory, a model in the local Hugging Face cache by name
    (``"gpt2"``, ``"org/name@revision"``; never downloaded), or a model object, as a
    blockformer model.

    ``tokenizer``: a ``tokenizer.json`` (or a directory with one) to use when the source has
    none (Marian ships only sentencepiece files)."""

    if not isinstance(source, (str, Path)) and not hasattr(getattr(source, "config", None), "to_dict"):
        raise TypeError(f"source: {kind_of(source)}; expected a Hugging Face model directory or transformers model")
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        raise TypeError(f"tokenizer: {kind_of(tokenizer)}; expected a path to a tokenizer.json, or None")
    if isinstance(source, str):  # a local directory wins; else a name in the local Hugging Face cache
        source = resolve_source(source)
    if isinstance(source, nn.Module):
        hf_cfg = source.config.to_dict()
        where = f"<{type(source).__name__}>"
        family = family_for_model_type(hf_cfg.get("model_type"), where)
        weights: Any = _StateDict(source.state_dict(), family.prefix, family.outside, where)
        tok_dir = None
    else:
        directory = Path(source)
        hf_cfg = read_hf_config(directory)
        where = str(directory / CONFIG)
        if "model_type" not in hf_cfg:
            raise UsageError(f"{where}: no 'model_type'; expected a Hugging Face config.json naming its family")
        family = family_for_model_type(hf_cfg["model_type"], where)
        weights = HFWeights(directory, family.prefix, family.outside)
        tok_dir = directory
    cfg = _config_from_hf(family, hf_cfg, weights.has, where)
    head = import_head(family, hf_cfg, weights.has, where, type(source).__name__ if isinstance(source, nn.Module) else None)
    cfg = cfg if head is None else head.body_config(cfg)
    found = None
    if tokenizer is not None:
        tok_path = Path(tokenizer)
        found = import_tokenizer(tok_path if tok_path.is_dir() else tok_path.parent, cfg.vocab_size, tok_path)
        if found is None:
            raise UsageError(f"{tok_path}: tokenizer not found; expected a tokenizer.json or a directory with one")
    elif tok_dir is not None:
        found = import_tokenizer(tok_dir, cfg.vocab_size)
    tok, vmap = found if found is not None else (None, VocabMap.identity(cfg.vocab_size))
    cfg = dataclasses.replace(cfg, vocab_size=vmap.size)
    model = build_model(cfg)
    _load(model, family, weights, vmap, head.names if head is not None else ())
    model = head.attach(model, weights) if head is not None else model
    return Imported(model=model.eval(), tokenizer=tok, config=cfg, family=family.name, vocab=vmap,
                    head=head.config if head is not None else None)


def _config_from_hf(family: Family, hf_cfg: dict, has, where: str) -> TransformerConfig:
    """The family's reading of ``config.json``; a value the model config refuses is named
    with the file it came from."""
    try:
        return family.config_from_hf(hf_cfg, has, where)
    except UsageError:
        raise
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: {e}") from None


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name of every parameter and persistent buffer, tied aliases included."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update({k: v for k, v in model.state_dict(keep_vars=True).items() if k not in out})
    return out


def _get(weights, family: Family, name: str) -> tuple[str, torch.Tensor]:
    for candidate in (name, *family.aliases.get(name, ()), *_old_norm_names(name)):
        if weights.has(candidate):
            return candidate, weights.get(candidate)
    return name, weights.get(name)  # raises: missing tensor


def _old_norm_names(name: str) -> tuple[str, ...]:
    """TensorFlow-era BERT files name LayerNorm weights gamma and beta."""
    if ".LayerNorm." in name:
        return (name.replace(".weight", ".gamma").replace(".bias", ".beta"),)
    return ()


@torch.no_grad()
def _load(model: nn.Module, family: Family, weights, vmap: VocabMap, head_names: tuple[str, ...] = ()) -> None:
    cfg: TransformerConfig = model.cfg
    params = _params(model)
    filled: set[int] = set()
    used: set[str] = set(head_names)  # a task head's tensors: read by interop.heads
    for rule in family.rules(cfg):
        param = params[rule.ours]
        parts = []
        for name, expected in zip(rule.theirs, _their_shapes(rule, param.shape, vmap, cfg)):
            used_name, t = _get(weights, family, name)
            used.add(used_name)
            if tuple(t.shape) != expected:
                raise UsageError(f"{weights.file_of(used_name)}: tensor {weights.name_in_file(used_name)!r} has shape {tuple(t.shape)}; "
                                 f"expected {expected} from config.json")
            parts.append(t.to(torch.float32))
        value = rule.to_ours(parts, cfg.rope_interleaved)
        param.copy_(vmap.to_ours(value) if rule.vocab else value)
        filled.add(id(param))
    missed = [n for n, p in model.named_parameters() if id(p) not in filled]
    if missed:  # a key map that forgets a parameter is a bug here, not bad input
        raise RuntimeError(f"the {family.name} key map fills no value for {missed[:3]}")
    skip = [re.compile(p) for p in family.ignore(cfg)]
    for name in sorted(weights.names() - used):
        if not any(p.fullmatch(name) for p in skip):
            raise UsageError(f"{weights.file_of(name)}: tensor {weights.name_in_file(name)!r} has no place in blockformer's "
                             f"{family.name} model (a head or option it does not import)")


def _their_shapes(rule: Rule, shape: torch.Size, vmap: VocabMap, cfg: TransformerConfig) -> list[tuple[int, ...]]:
    if rule.vocab:
        shape = torch.Size((vmap.n_theirs, *shape[1:]))
    return [tuple(p.shape) for p in rule.to_theirs(torch.empty(shape, device="meta"), False)]


# ---------------------------------------------------------------------- export
def to_hf(
    source: str | Path | nn.Module, out: str | Path, *, tokenizer: Tokenizer | None = None, overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, labels: Sequence[str] | None = None,
) -> Path:
    """Write a blockformer checkpoint (or model, with its tokenizer) as a Hugging Face
    directory: ``config.json``, ``model.safetensors`` and, for a ``tokenizers`` tokenizer,
    ``tokenizer.json`` with a ``tokenizer_config.json``, and a ``README.md`` model card.
    Weights past ``max_shard_size`` (``"500MB"``, ``"2GB"``, bytes) are sharded with an index.
    ``out`` must be new or empty (or, with ``overwrite``, is replaced whole), and never the
    source or a directory around it. A ``TaskModel`` is written as the family's
    ``...ForSequenceClassification``/``...ForTokenClassification`` (``interop.heads``), its
    labels the checkpoint's (or ``labels``; else ``LABEL_i``)."""

    if not isinstance(source, (str, Path)) and not isinstance(getattr(source, "cfg", None), TransformerConfig):
        raise TypeError(f"source: {kind_of(source)}; expected a blockformer checkpoint directory or model")
    if not isinstance(out, (str, Path)):
        raise TypeError(f"out: {kind_of(out)}; expected a directory path")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer: {kind_of(tokenizer)}; expected a Tokenizer or None")
    max_bytes = parse_size(max_shard_size, "max_shard_size")
    check_target(Path(out), None if isinstance(source, nn.Module) else Path(source), overwrite=overwrite)
    if isinstance(source, nn.Module):
        model = source
    else:

        ckpt = load_checkpoint(source)
        model, tokenizer = ckpt.model, ckpt.tokenizer
        labels = ckpt.config.head.labels if labels is None else labels
    cfg: TransformerConfig = model.cfg
    family = family_for_config(cfg)
    family.check_exportable(cfg)  # every field: mapped, or at a value the family computes
    vmap = VocabMap.identity(cfg.vocab_size)
    if isinstance(tokenizer, BPETokenizer):
        order = tokenizer.source_ids()
        vmap = VocabMap(_extend(order, cfg.vocab_size), cfg.vocab_size)
    tensors = _export_tensors(model.body if isinstance(model, TaskModel) else model, family, vmap)
    tensors.update(family.extra(cfg))
    ids = hf_special_ids(tokenizer, vmap) if tokenizer is not None else {r: i for i, r in enumerate(("pad", "bos", "eos", "unk"))}
    files = {}
    if isinstance(tokenizer, BPETokenizer):
        roles = token_roles(tokenizer, ids, cfg.arch)  # pad ... unk, and cls/sep/mask where the model has them
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len, **roles}
        files = {FILE_NAME: tokenizer.hf.to_str(pretty=True), "tokenizer_config.json": json.dumps(tok_cfg, indent=2) + "\n",
                 "special_tokens_map.json": json.dumps(roles, indent=2) + "\n"}
    out = Path(out)
    hf_config = family.config_to_hf(cfg, ids)
    files["generation_config.json"] = json.dumps(generation_config(cfg, hf_config), indent=2) + "\n"
    if isinstance(model, TaskModel):  # the head's tensors and labels; refused where the family's head differs
        export_head(model, family.name, labels, tensors, hf_config)
        if FILE_NAME in files:  # texts reach the head as <s> text </s>, as blockformer's labelled data
            files[FILE_NAME] = task_tokenizer_json(tokenizer.hf, ids["bos"], ids["eos"])
    where = f"`{source}`" if isinstance(source, (str, Path)) else f"a {type(model).__name__} object (in memory)"
    files["README.md"] = model_card(hf_config, cfg.to_dict(), source=where, family=family.name, out=str(out),
                                    n_params=sum(p.numel() for p in model.parameters()), tokenizer=FILE_NAME in files)
    write_hf_dir(out, hf_config, tensors, files, max_shard_size=max_bytes)
    return out


def check_target(out: Path, source: Path | None, *, overwrite: bool, flag: str = "out") -> None:
    """Refuse an output directory whose replacement would destroy what the user did not
    name: the source, or a directory holding it or inside it (always); a file (always); a
    directory holding anything (unless ``overwrite``). A new or empty directory is fine."""
    how = "pass --overwrite" if flag.startswith("--") else "pass overwrite=True"
    try:
        o, cwd = out.resolve(), Path.cwd().resolve()
        s = source.resolve() if source is not None else None
    except (OSError, RuntimeError) as e:  # a symlink loop, a vanished working directory
        raise UsageError(f"{flag} {out}: cannot resolve the path ({e})") from None
    if s is not None and (o == s or o.is_relative_to(s) or s.is_relative_to(o)):
        relation = "is" if o == s else "is inside" if o.is_relative_to(s) else "holds"
        raise UsageError(f"{flag} {out}: {relation} the source {source}; expected a directory outside it")
    if cwd.is_relative_to(o):  # replacing it would pull the working directory away
        raise UsageError(f"{flag} {out}: is or holds the current directory; expected a directory beside it, e.g. {flag} out")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {out}: is a file; expected a directory to write (a new name, or an empty one)")
    what = _contents(out)
    if what and not overwrite:
        raise UsageError(f"{flag} {out}: already holds {what}, which writing there would replace; expected a new "
                         f"or empty directory ({how} to replace it)")


def _contents(directory: Path) -> str:
    """What a directory holds, as a few words ('' when it is missing or empty)."""

    entries = sorted(directory.iterdir()) if directory.is_dir() else []
    if not entries:
        return ""
    n = len(step_checkpoints(directory))
    if n:
        return f"{n} checkpoint{'s' * (n != 1)} of a training run"
    if (directory / CONFIG).is_file():  # a checkpoint, or a Hugging Face model
        return f"a model ({', '.join(p.name for p in entries[:3])}{', ...' if len(entries) > 3 else ''})"
    return f"{len(entries)} entr{'ies' if len(entries) != 1 else 'y'} ({entries[0].name}{', ...' if len(entries) > 1 else ''})"


def _extend(order, size: int):
    import numpy as np  # noqa: PLC0415

    return np.concatenate([order, np.arange(len(order), size)]) if len(order) < size else order


@torch.no_grad()
def _export_tensors(model: nn.Module, family: Family, vmap: VocabMap) -> dict[str, torch.Tensor]:
    cfg: TransformerConfig = model.cfg
    params = _params(model)
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for rule in family.rules(cfg):
        t = params[rule.ours].detach().float().cpu()
        if rule.vocab:
            t = vmap.to_theirs(t)
        for name, part in zip(rule.theirs, rule.to_theirs(t, cfg.rope_interleaved)):
            if name in out and not torch.equal(out[name], part):
                raise UsageError(f"model: {rule.ours} differs from {source[name]}; Hugging Face {family.name} "
                                 f"keeps one tensor {name!r} for both")
            out[name], source[name] = part, rule.ours
    return out
