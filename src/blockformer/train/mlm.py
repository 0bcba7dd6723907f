"""The masked-language-model objective: an encoder learns from any text a decoder learns from.

Training windows come from the same token file as language modelling; each is corrupted
by ``mask_tokens`` (BERT's 15% / 80-10-10) and the loss is the cross-entropy at the
selected positions only, through the encoder's own output head (tied to the token
embedding). Evaluation masks the validation windows with a fixed seed, so every evaluation
scores the same positions, and reports the masked-token accuracy beside the loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..data.lm import LMDataset
from ..data.masking import MaskingRates, mask_tokens
from ..run_config import TrainConfig
from ..tokenizers import PAD_ID
from ..nn.loss import token_loss
from .objective import Objective

if TYPE_CHECKING:
    from ..data.describe import TaskData


class MLMBatch(NamedTuple):
    inputs: torch.Tensor  # corrupted
    targets: torch.Tensor  # PAD where not selected
    n_selected: int | None = None  # counted on the host before the move: no device sync per step


EVAL_SEED = 1234


class MaskedLM(Objective):
    rows_split = True  # an MLMBatch is a named tuple of row tensors

    def __init__(self, train: LMDataset, val: LMDataset, batch_size: int, seed: int, device: torch.device,
                 vocab_size: int, rates: MaskingRates) -> None:
        self.train, self.val, self.batch_size, self.device = train, val, batch_size, device
        self.vocab_size, self.rates = vocab_size, rates
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_data(cls, data: TaskData, device: torch.device) -> MaskedLM:
        b, tc = data.batches, data.config.train
        rates = MaskingRates(tc.mask_rate, tc.mask_token_rate, tc.random_token_rate)
        return cls(b.train, b.val, tc.batch_size, tc.seed, device, data.tokenizer.vocab_size, rates)

    def _corrupt(self, x: torch.Tensor, generator: torch.Generator) -> MLMBatch:
        inputs, targets = mask_tokens(x, self.vocab_size, self.rates, generator)
        n_selected = int((targets != PAD_ID).sum())
        return MLMBatch(inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True), n_selected)

    def next_batch(self) -> MLMBatch:
        x, _ = self.train.sample(self.batch_size, self.generator)
        return self._corrupt(x, self.generator)

    def loss(self, model: nn.Module, batch: MLMBatch, label_smoothing: float = 0.0) -> torch.Tensor:
        inputs, targets = batch[0], batch[1]
        return model(inputs, targets=targets, label_smoothing=label_smoothing)  # PAD targets are ignored

    def count_targets(self, batch: MLMBatch) -> int:
        n = getattr(batch, "n_selected", None)
        n = int((batch[1] != PAD_ID).sum()) if n is None else n
        return max(n, 1)

    def count_tokens(self, batch: MLMBatch) -> int:
        return batch[0].numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, cfg: TrainConfig) -> dict[str, float]:
        was_training = model.training
        model.eval()
        generator = torch.Generator().manual_seed(EVAL_SEED)
        total, count, correct = 0.0, 0, 0
        for x, _ in self.val.eval_batches(cfg.batch_size, cfg.eval_batches):
            inputs, targets, _ = self._corrupt(x, generator)
            logits = model(inputs)
            selected = targets != PAD_ID
            total += float(token_loss(logits, targets))
            count += int(selected.sum())
            correct += int((logits.argmax(-1) == targets)[selected].sum())
        model.train(was_training)
        return {"val_loss": total / max(count, 1), "masked_accuracy": correct / max(count, 1)}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
