"""What the loop optimises: batches, their loss, and how a model is evaluated.

Two objectives, chosen by the data: language modelling (a decoder predicts the next token
of random windows of a token file) and sequence-to-sequence (an encoder-decoder predicts
the target given the source, on aligned pairs or a synthetic task). The loop sees only
``next_batch``, ``loss``, ``evaluate`` and the data position in ``state_dict``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ..data.buckets import pad_to_bucket
from ..data.lm import LMDataset
from ..data.seq2seq import Seq2SeqBatch
from ..data.tasks import Task, TaskBatches, exact_match
from ..generate import greedy_decode
from ..run_config import TrainConfig
from ..tokenizers import EOS_ID

if TYPE_CHECKING:
    from ..data.describe import TaskData

LMBatch = tuple[torch.Tensor, torch.Tensor]


class Objective:
    """The interface the loop uses (see the two subclasses); ``from_data`` builds one from a
    task description whose batches are loaded (``data.describe``)."""

    token_loss = True  # the loss is a mean over tokens (a perplexity is reported)
    rows_split = False  # parallel.data.shard_batch splits its batches by rows (train.batch_threads)

    @classmethod
    def from_data(cls, data: TaskData, device: torch.device) -> Objective:
        raise NotImplementedError

    def next_batch(self) -> Any:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any, label_smoothing: float = 0.0) -> torch.Tensor:
        """Summed token loss of ``batch`` (divide by ``count_targets`` for the mean)."""
        raise NotImplementedError

    def count_targets(self, batch: Any) -> int:
        raise NotImplementedError

    def count_tokens(self, batch: Any) -> int:
        """Tokens the model reads for ``batch`` (for tokens/s)."""
        return self.count_targets(batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, cfg: TrainConfig) -> dict[str, float]:
        """Validation loss (without label smoothing), and task metrics where there are some."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _mean_loss(model: nn.Module, objective: Objective, batches: Iterator[Any]) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        total += float(objective.loss(model, batch))
        count += objective.count_targets(batch)
    model.train(was_training)
    return total / max(count, 1)


class LanguageModelling(Objective):
    """Next-token prediction on random windows; the window sampler's generator is the data
    position, so resuming restores it."""

    rows_split = True

    def __init__(
        self, train: LMDataset, val: LMDataset, batch_size: int, seed: int, device: torch.device
    ) -> None:
        self.train, self.val, self.batch_size, self.device = train, val, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_data(cls, data: TaskData, device: torch.device) -> LanguageModelling:
        b, tc = data.batches, data.config.train
        return cls(b.train, b.val, tc.batch_size, tc.seed, device)

    def next_batch(self) -> LMBatch:
        x, y = self.train.sample(self.batch_size, self.generator)
        if self.device.type == "cuda":  # pinned: the copy is asynchronous, the CPU runs ahead
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def loss(self, model: nn.Module, batch: LMBatch, label_smoothing: float = 0.0) -> torch.Tensor:
        x, y = batch
        return model(x, targets=y, label_smoothing=label_smoothing)  # the head fused with the loss

    def count_targets(self, batch: LMBatch) -> int:
        return batch[1].numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, cfg: TrainConfig) -> dict[str, float]:
        windows = self.val.eval_batches(cfg.batch_size, cfg.eval_batches)
        batches = ((x.to(self.device), y.to(self.device)) for x, y in windows)
        return {"val_loss": _mean_loss(model, self, batches)}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


class Seq2Seq(Objective):
    """Target given source. Training batches come from a ``TokenBatcher`` (aligned pairs,
    by token count) or ``TaskBatches`` (a synthetic task, drawn from a generator); the
    validation batches are fixed; a task also reports exact match by greedy decoding."""

    rows_split = True

    def __init__(
        self,
        train: Any,
        val_batches: list[Seq2SeqBatch],
        device: torch.device,
        *,
        seed: int = 0,
        task: Task | None = None,
        tokenizer: Any = None,
        buckets: list[int] | None = None,
    ) -> None:
        self.train, self.val_batches, self.device = train, val_batches, device
        self.buckets = buckets  # synthetic tasks: pad to these lengths (a TokenBatcher pads itself)
        self.task, self.tokenizer = task, tokenizer
        self.generator = torch.Generator().manual_seed(seed)
        self._stream = None if isinstance(train, TaskBatches) else train.stream()

    @classmethod
    def from_data(cls, data: TaskData, device: torch.device) -> Seq2Seq:
        """Aligned pairs (a ``TokenBatcher``) or a synthetic task, as the description has them."""
        b = data.batches
        return cls(b.train, b.val, device, seed=data.config.train.seed, task=b.task, tokenizer=data.tokenizer,
                   buckets=b.buckets)

    def next_batch(self) -> Seq2SeqBatch:
        batch = self.train.sample(self.generator) if self._stream is None else next(self._stream)
        if self.buckets and self._stream is None:
            batch = pad_to_bucket(batch, self.buckets, len(batch))
        return batch.to(self.device, non_blocking=True)

    def loss(self, model: nn.Module, batch: Seq2SeqBatch, label_smoothing: float = 0.0) -> torch.Tensor:
        return model(batch.src, batch.tgt_in, src_mask=batch.src_mask, tgt_mask=batch.tgt_mask,
                     targets=batch.tgt_out, label_smoothing=label_smoothing)

    def count_targets(self, batch: Seq2SeqBatch) -> int:
        return batch.num_tokens

    def count_tokens(self, batch: Seq2SeqBatch) -> int:
        return batch.num_tokens + batch.num_src_tokens  # counted on the CPU: no sync

    @torch.no_grad()
    def evaluate(self, model: nn.Module, cfg: TrainConfig) -> dict[str, float]:
        val_loss = _mean_loss(model, self, (b.to(self.device) for b in self.val_batches[: cfg.eval_batches]))
        metrics = {"val_loss": val_loss}
        if self.task is not None:
            metrics["exact_match"] = self.exact_match(model, cfg.eval_samples, cfg.batch_size)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        if self._stream is None:
            return {"generator": self.generator.get_state()}
        return {"batcher": self.train.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._stream is None:
            self.generator.set_state(state["generator"])
        else:
            self.train.load_state_dict(state["batcher"])
            self._stream = self.train.stream()

    @torch.no_grad()
    def exact_match(self, model: nn.Module, n: int, batch_size: int = 64) -> float:
        """Fraction of the first ``n`` held-out pairs decoded (greedily) exactly."""
        pairs = self.task.heldout(min(n, self.task.n_heldout))
        predictions = translate_greedy(model, self.tokenizer, [s for s, _ in pairs], batch_size)
        return exact_match(predictions, [t for _, t in pairs])


def translate_greedy(model: nn.Module, tokenizer: Any, sources: list[str], batch_size: int = 64) -> list[str]:
    """Greedy outputs of an encoder-decoder for ``sources``, in order (at most source + 50 tokens)."""
    ids = [tokenizer.encode(s) + [EOS_ID] for s in sources]  # sources end with eos, as in training
    out: list[str] = []
    for i in range(0, len(ids), batch_size):
        out.extend(tokenizer.decode(row) for row in greedy_decode(model, ids[i : i + batch_size]))
    return out
