"""The task-head objective: losses, batches and metrics for labelled examples.

Losses are summed over what ``count_targets`` counts (the loop divides), so gradient
accumulation weighs micro-batches correctly:

- ``classify``: cross-entropy, optionally class-weighted (each example's loss times its
  class's weight), per example;
- ``multilabel``: binary cross-entropy on each label's logit, per (example, label);
- ``tokens``: cross-entropy per labelled token (padding, specials and a word's later tokens
  are skipped);
- ``regress``: squared error, per example.

Evaluation reports the loss, accuracy and macro F1 (the unweighted mean of the per-class
F1 scores, which a majority-class guess cannot inflate); ``evaluate_full`` adds the
confusion matrix (rows: true label, columns: predicted) for the eval JSON.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.labelled import IGNORE, LabelledBatch, LabelledData
from ..models.base import with_auxiliary_loss
from ..run_config import TrainConfig
from .objective import Objective

if TYPE_CHECKING:
    from ..data.describe import TaskData


def head_loss(task: str, output: torch.Tensor, targets: torch.Tensor,
              weights: torch.Tensor | None = None, label_smoothing: float = 0.0) -> torch.Tensor:
    """The summed loss of a head's ``output`` against ``targets`` (see the module docstring);
    ``label_smoothing`` (Szegedy et al. 2016) applies to the cross-entropies of ``classify``
    and ``tokens``."""
    output = output.float()  # a bf16 log-softmax loses the small differences training needs
    w = None if weights is None else weights.to(output.device)
    if task == "classify":
        return F.cross_entropy(output, targets, weight=w, reduction="sum", label_smoothing=label_smoothing)
    if task == "multilabel":
        return F.binary_cross_entropy_with_logits(output, targets, weight=w, reduction="sum")
    if task == "tokens":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1), weight=w,
                               ignore_index=IGNORE, reduction="sum", label_smoothing=label_smoothing)
    if task == "regress":
        return ((output.squeeze(-1) - targets) ** 2).sum()
    raise ValueError(f"head.task={task!r}: expected classify, multilabel, tokens or regress")


def head_output(model: nn.Module, batch: LabelledBatch) -> torch.Tensor:
    """The task model's output for ``batch``, with its segment ids when it carries them (text
    pairs, encoded for a model with a segment table: ``data.describe.labelled_data``)."""
    if batch.token_types is None:
        return model(batch.tokens, attention_mask=batch.mask)
    return model(batch.tokens, attention_mask=batch.mask, token_types=batch.token_types)


def count_head_targets(task: str, targets: torch.Tensor, n_labelled: int | None = None) -> int:
    """The examples (or labelled tokens, or label slots) the loss averages over;
    ``n_labelled``, counted on the host, spares a device sync for token tasks."""
    if task == "tokens":
        return max(n_labelled if n_labelled is not None else int((targets != IGNORE).sum()), 1)
    return targets.numel()  # examples, or (example, label) pairs for multilabel


def probabilities(task: str, output: torch.Tensor) -> torch.Tensor:
    """What a head's output means: class probabilities, label probabilities, or values."""
    output = output.float()
    if task in ("classify", "tokens"):
        return output.softmax(-1)
    if task == "multilabel":
        return output.sigmoid()
    return output.squeeze(-1)


def f1_scores(confusion: torch.Tensor) -> torch.Tensor:
    """Per-class F1 from a (true, predicted) confusion matrix; 0 where undefined."""
    tp = confusion.diag().float()
    precision = tp / confusion.sum(0).clamp(min=1)
    recall = tp / confusion.sum(1).clamp(min=1)
    return torch.where(tp > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-12), torch.zeros_like(tp))


def macro_f1(confusion: torch.Tensor) -> float:
    """The mean F1 over the classes that occur as truth or prediction (as scikit-learn)."""
    present = (confusion.sum(0) + confusion.sum(1)) > 0
    return float(f1_scores(confusion)[present].mean()) if present.any() else 0.0


def confusion_matrix(true: torch.Tensor, pred: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(true * n + pred, minlength=n * n).reshape(n, n)


class TaskHead(Objective):
    """Training batches drawn at random (with replacement) from the training examples; the
    generator is the data position."""

    token_loss = False

    def __init__(self, train: LabelledData, val: LabelledData, batch_size: int, seed: int,
                 device: torch.device, weights: torch.Tensor | None = None) -> None:
        self.train, self.val, self.batch_size, self.device = train, val, batch_size, device
        self.task, self.weights = train.task, weights
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_data(cls, data: TaskData, device: torch.device) -> TaskHead:
        """Labelled examples (``LabelledData``) or arrays (``ArrayData``) and the loss weights."""
        b, tc = data.batches, data.config.train
        return cls(b.train, b.val, tc.batch_size, tc.seed, device, b.class_weights)

    def next_batch(self) -> LabelledBatch:
        rows = torch.randint(len(self.train), (self.batch_size,), generator=self.generator).tolist()
        return self.train.batch(rows).to(self.device, non_blocking=True)

    def loss(self, model: nn.Module, batch: LabelledBatch, label_smoothing: float = 0.0) -> torch.Tensor:
        out = head_output(model, batch)
        loss = head_loss(self.task, out, batch.targets, self.weights, label_smoothing)
        return with_auxiliary_loss(model, loss, lambda: self.count_targets(batch))  # a task head over MoE blocks

    def count_targets(self, batch: LabelledBatch) -> int:
        return count_head_targets(self.task, batch.targets, batch.n_labelled)

    def count_tokens(self, batch: LabelledBatch) -> int:
        return batch.n_tokens if batch.n_tokens is not None else int(batch.mask.sum())

    @torch.no_grad()
    def evaluate(self, model: nn.Module, cfg: TrainConfig) -> dict[str, float]:
        return {k: v for k, v in self.evaluate_full(model, cfg.batch_size).items() if isinstance(v, float)}

    @torch.no_grad()
    def evaluate_full(self, model: nn.Module, batch_size: int) -> dict[str, Any]:
        """Loss and metrics on every held-out example, with the confusion matrix."""
        was_training = model.training
        model.eval()
        total, count, outputs, targets, masks = 0.0, 0, [], [], []
        for batch in self.val.batches(batch_size):
            batch = batch.to(self.device)
            out = head_output(model, batch)
            total += float(head_loss(self.task, out, batch.targets))  # unweighted: comparable across runs
            count += count_head_targets(self.task, batch.targets)
            outputs.append(out.float().cpu())
            targets.append(batch.targets.cpu())
        model.train(was_training)
        metrics: dict[str, Any] = {"val_loss": total / max(count, 1)}
        return {**metrics, **self._metrics(outputs, targets)}

    def _metrics(self, outputs: list[torch.Tensor], targets: list[torch.Tensor]) -> dict[str, Any]:
        if self.task == "regress":
            err = torch.cat([o.squeeze(-1) - t for o, t in zip(outputs, targets)])
            return {"mae": float(err.abs().mean())}
        if self.task == "multilabel":
            pred = torch.cat(outputs) > 0
            true = torch.cat(targets) > 0.5
            tp = (pred & true).sum(0).float()
            f1 = 2 * tp / (pred.sum(0) + true.sum(0)).clamp(min=1)
            return {"exact_match": float((pred == true).all(-1).float().mean()), "macro_f1": float(f1.mean())}
        if self.task == "tokens":
            pred = torch.cat([o.argmax(-1).flatten() for o in outputs])
            true = torch.cat([t.flatten() for t in targets])
            keep = true != IGNORE
            pred, true = pred[keep], true[keep]
        else:
            pred, true = torch.cat([o.argmax(-1) for o in outputs]), torch.cat(targets)
        n = len(self.train.names)
        confusion = confusion_matrix(true, pred, n)
        return {
            "accuracy": float((pred == true).float().mean()),
            "macro_f1": macro_f1(confusion),
            "labels": list(self.train.names),
            "confusion_matrix": confusion.tolist(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
