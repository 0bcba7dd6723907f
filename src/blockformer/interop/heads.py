"""Task heads across the two libraries: a blockformer ``TaskModel`` (body + ``SequenceHead``
or ``TokenHead``) is Hugging Face's ``...ForSequenceClassification`` or
``...ForTokenClassification``, where the family's head computes the same thing.

Per family (``LAYOUTS``): the class name, the linear layer's tensor name, whether it has a
bias, and what the sequence head pools::

    family  sequence head                                       token head
    bert    pooler (dense + tanh on [CLS]) -> classifier        each position -> classifier
    gpt2    score (no bias) at the last non-pad token           each position -> classifier
    llama   score (no bias) at the last non-pad token           each position -> score

A head that computes something else (``cls`` or ``mean`` pooling for BERT, whose classifier
always reads the pooler; a decoder head with a non-zero bias) is refused naming the field.
Labels travel as ``id2label``/``label2id``; the task as ``problem_type``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..config import TransformerConfig
from ..errors import UsageError
from ..models.heads import SequenceHead, TaskModel, TokenHead, build_head
from ..run_config import HeadConfig, RunConfig
from ..train.build import body_pooler
from .families import Family


@dataclass(frozen=True)
class Layout:
    name: str  # the class names' stem: Bert -> BertForSequenceClassification
    sequence: str  # the sequence head's linear layer
    pooling: str  # the blockformer pooling that computes what the family's sequence head reads
    sequence_bias: bool
    tokens: str  # the token head's linear layer (always with a bias)
    lm_tensors: tuple[str, ...]  # prefixes of the body's LM-head tensors, which a task class lacks
    pooler_tensors: tuple[str, ...] = ()  # the pooler: kept by the sequence class, not the token class


LAYOUTS = {
    "bert": Layout("Bert", "classifier", "pooler", True, "classifier", ("cls.",), ("bert.pooler.",)),
    "gpt2": Layout("GPT2", "score", "last", False, "classifier", ("lm_head.",)),
    "llama": Layout("Llama", "score", "last", False, "score", ("lm_head.",)),
}
READS = {"pooler": "the pooler's output (dense + tanh on [CLS])", "last": "the last non-pad token"}
PROBLEM_TYPES = {"classify": "single_label_classification", "multilabel": "multi_label_classification",
                 "regress": "regression"}
SEQUENCE, TOKENS = "ForSequenceClassification", "ForTokenClassification"


def head_task(head: nn.Module) -> str:
    """``tokens``, or the ``SequenceHead``'s task (classify, multilabel, regress)."""
    if isinstance(head, TokenHead):
        return "tokens"
    if isinstance(head, SequenceHead):
        return head.task
    raise UsageError(f"head: a {type(head).__name__} has no Hugging Face counterpart; expected a SequenceHead "
                     f"or TokenHead")


def label_names(labels: Sequence[str] | None, n: int) -> list[str]:
    """The run's label names, or Hugging Face's ``LABEL_i`` where there are none (regression)."""
    if not labels:
        return [f"LABEL_{i}" for i in range(n)]
    if len(labels) != n or len(set(labels)) != n:
        raise UsageError(f"labels: {len(labels)} names ({len(set(labels))} distinct) for a head of {n} outputs; "
                         f"expected {n} distinct names")
    return [str(name) for name in labels]


@torch.no_grad()
def export_head(model: TaskModel, family: str, labels: Sequence[str] | None, tensors: dict[str, torch.Tensor],
                hf_config: dict[str, Any]) -> None:
    """Turn an exported body (``tensors``, ``hf_config``, changed in place) into the family's
    task class: the head's tensors added, the LM head's dropped, the labels and task in the
    config. Refuses a head the family computes differently, naming the field."""
    head, task = model.head, head_task(model.head)
    layout = LAYOUTS.get(family)
    if layout is None:
        raise UsageError(f"head.task={task!r} has no counterpart in Hugging Face {family} here; expected a "
                         f"{', '.join(LAYOUTS)} body")
    if task == "tokens":
        drop = layout.lm_tensors + layout.pooler_tensors
        cls, layer, bias = layout.name + TOKENS, layout.tokens, True
    else:
        cls, layer, bias, drop = layout.name + SEQUENCE, layout.sequence, layout.sequence_bias, layout.lm_tensors
        if head.pooling != layout.pooling:
            no_pooler = layout.pooling == "pooler" and not model.cfg.pooler
            needs = " (with model.pooler=true: the body has none)" if no_pooler else ""
            raise UsageError(f"head.pooling={head.pooling!r} has no counterpart in Hugging Face {cls}, which "
                             f"classifies {READS[layout.pooling]}; expected head.pooling={layout.pooling!r}{needs}")
        if layout.pooling == "pooler" and not any(k.startswith(layout.pooler_tensors) for k in tensors):
            raise UsageError(f"model.pooler=False: Hugging Face {cls} needs the body's pooler; expected "
                             f"model.pooler=true")
        b = head.proj.bias
        if not bias and b is not None and bool(b.ne(0).any()):
            raise UsageError(f"head.bias=True: the head's bias is not zero (max |b| = {b.abs().max().item():.3g}) "
                             f"but Hugging Face {cls}'s {layer} layer has none; expected a head trained with "
                             f"head.bias=false")
    for name in [k for k in tensors if k.startswith(drop)]:
        del tensors[name]
    weight = head.proj.weight.detach().float().cpu()
    tensors[f"{layer}.weight"] = weight
    if bias:
        b = head.proj.bias
        tensors[f"{layer}.bias"] = torch.zeros(weight.shape[0]) if b is None else b.detach().float().cpu()
    names = label_names(labels, weight.shape[0])
    hf_config.update(architectures=[cls], num_labels=len(names), id2label=dict(enumerate(names)),
                     label2id={n: i for i, n in enumerate(names)}, classifier_dropout=head.dropout.p)
    if task != "tokens":
        hf_config["problem_type"] = PROBLEM_TYPES[task]


def task_tokenizer_json(hf_tokenizer: Any, bos: int, eos: int) -> str:
    """The exported ``tokenizer.json`` for a task model: blockformer reads every labelled text
    as ``<s> text </s>``, so a tokenizer that does not add those itself (a blockformer BPE,
    GPT-2's) gets a template that does, and a pipeline feeds the head the ids it was trained
    on. One that already adds them (BERT's ``[CLS] $A [SEP]``) is written as it is."""
    from tokenizers import Tokenizer, processors  # noqa: PLC0415

    tok = Tokenizer.from_str(hf_tokenizer.to_str())
    bare = tok.encode("a", add_special_tokens=False).ids
    if tok.encode("a").ids == [bos, *bare, eos]:
        return tok.to_str(pretty=True)
    b, e = tok.id_to_token(bos), tok.id_to_token(eos)
    template = processors.TemplateProcessing(single=f"{b} $A {e}", special_tokens=[(b, bos), (e, eos)])
    tok.post_processor = template if tok.post_processor is None else processors.Sequence([tok.post_processor, template])
    return tok.to_str(pretty=True)


# ---------------------------------------------------------------------- import
@dataclass
class ImportedHead:
    """A Hugging Face task head found in a file: the run config's ``[head]`` section, and the
    tensors that fill ``head.proj``."""

    config: HeadConfig
    weight: str
    bias: str | None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight,) + ((self.bias,) if self.bias else ())

    @staticmethod
    def body_config(cfg: TransformerConfig) -> TransformerConfig:
        """The body a task class carries: no LM head of its own (``LlamaForSequenceClassification``
        has no ``lm_head``), so the body's unused one is the tied embedding."""
        return dataclasses.replace(cfg, tie_embeddings=True)

    @torch.no_grad()
    def attach(self, body: nn.Module, weights) -> TaskModel:
        """``body`` with this head, its weights read from ``weights``; labels the file does
        not name become ``LABEL_i``."""
        h, w = self.config, weights.get(self.weight)
        if h.task != "regress" and not h.labels:
            h.labels = label_names(None, w.shape[0])
        n = 1 if h.task == "regress" else len(h.labels)
        if tuple(w.shape) != (n, body.cfg.d_model):
            raise UsageError(f"{weights.file_of(self.weight)}: tensor {weights.name_in_file(self.weight)!r} has shape "
                             f"{tuple(w.shape)}; expected {(n, body.cfg.d_model)} from config.json (id2label)")
        head = build_head(h.task, body.cfg.d_model, n, h.pooling, h.dropout, bias=h.bias,
                          pooler=body_pooler(RunConfig(model=body.cfg, head=h), body))
        head.proj.weight.copy_(w.float())
        if head.proj.bias is not None:  # a file without one (Llama's token_classification_bias=false): zero
            head.proj.bias.copy_(weights.get(self.bias).float() if self.bias else torch.zeros(n))
        return TaskModel(body, head)


def import_head(family: Family, hf_cfg: dict[str, Any], has, where: str, model_class: str | None = None
                ) -> ImportedHead | None:
    """The task head ``config.json``'s ``architectures`` (or a model object's ``model_class``)
    names; None for a base or LM model. A head the family's layout does not know is left to
    the key map, which refuses its tensors. ``has``: whether the weights hold a tensor (by its
    name with the family's prefix, which the readers add to head names)."""
    layout, prefix = LAYOUTS.get(family.name), family.prefix
    archs = hf_cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    arch = model_class or arch
    if layout is None or arch not in (layout.name + SEQUENCE, layout.name + TOKENS):
        return None
    tokens = arch.endswith(TOKENS)
    layer = layout.tokens if tokens else layout.sequence
    weight, bias = prefix + layer + ".weight", prefix + layer + ".bias"
    if not has(weight):
        raise UsageError(f"{where}: architectures={arch!r} but the weights hold no {layer}.weight; expected the "
                         f"head's tensors")
    id2label = hf_cfg.get("id2label") or {}
    try:
        labels = [str(id2label[k]) for k in sorted(id2label, key=int)]
    except (TypeError, ValueError):
        raise UsageError(f"{where}: id2label={id2label!r}; expected an object of id -> label name") from None
    problem = hf_cfg.get("problem_type")
    if tokens:
        task = "tokens"
    elif problem == "regression" or (problem is None and len(labels) == 1):
        task, labels = "regress", []
    elif problem == "multi_label_classification":
        task = "multilabel"
    else:
        task = "classify"
    dropout = hf_cfg.get("classifier_dropout")
    dropout = dropout if isinstance(dropout, float) and 0.0 <= dropout < 1.0 else 0.1
    head = HeadConfig(task=task, pooling="auto" if tokens else layout.pooling, dropout=dropout,
                      bias=tokens or has(bias), labels=labels)
    return ImportedHead(head, weight, bias if has(bias) else None)
