"""Labelled examples for a task head: reading, label ids, encoding and padded batches.

A labelled file is either ``text<TAB>label`` lines (the label after the last tab) or JSON
lines with ``"text"`` and ``"label"`` (chosen by a ``.jsonl``/``.json`` suffix, or a first
line that starts with ``{``). What a label is depends on the head's task:

- ``classify``: a name (``"spam"``; numbers are read as their text);
- ``multilabel``: a list of names (JSON), or names separated by commas (TSV);
- ``tokens``: one name per whitespace-separated word of the text (JSON list, or the TSV
  label field split on whitespace); a word's first token carries its label;
- ``regress``: a number.

Every sequence is encoded as ``<s> text </s>`` (truncated to ``max_len``), so position 0
is a dedicated summary token for ``cls`` pooling and the last real position (``</s>``)
has read the whole text, even in a causal decoder.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import UsageError
from ..textformats import loads_json
from ..tokenizers import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from .seq2seq import _read_lines

IGNORE = -100  # token targets the loss skips (padding, specials, a word's later tokens)
Example = tuple[str, Any]  # (text, raw label)


def is_jsonl(path: Path, first_line: str) -> bool:
    return path.suffix in (".jsonl", ".json") or first_line.lstrip().startswith("{")


def read_labelled(path: str | Path) -> list[Example]:
    """``(text, label)`` of every non-empty line of a labelled file (see the module docstring)."""
    path = Path(path)
    lines = _read_lines(path, "text<TAB>label lines or JSONL with text and label")
    lines_nonempty = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not lines_nonempty:
        raise UsageError(f"{path}: empty file; expected text<TAB>label lines or JSONL")
    jsonl = is_jsonl(path, lines_nonempty[0][1])
    examples = []
    for i, line in lines_nonempty:
        if jsonl:
            try:
                record = loads_json(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or "text" not in record or "label" not in record:
                raise UsageError(f"{path}:{i}: expected a JSON object with \"text\" and \"label\"")
            if not isinstance(record["text"], str):
                raise UsageError(f"{path}:{i}: \"text\" must be a string")
            examples.append((record["text"], record["label"]))
        else:
            if "\t" not in line:
                raise UsageError(f"{path}:{i}: no tab; expected text<TAB>label")
            text, label = line.rsplit("\t", 1)
            examples.append((text, label))
    return examples


def read_texts(path: str | Path) -> list[str]:
    """Texts to predict: JSONL ``"text"`` fields, the text before the last tab of a TSV line,
    or whole lines of any other file."""
    path = Path(path)
    lines = [line for line in _read_lines(path, "one text per line, TSV or JSONL") if line.strip()]
    if not lines:
        raise UsageError(f"{path}: empty file; expected one text per line, TSV or JSONL")
    if is_jsonl(path, lines[0]):
        out = []
        for i, line in enumerate(lines, 1):
            try:
                record = loads_json(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UsageError(f"{path}:{i}: expected a JSON object with a \"text\" string")
            out.append(record["text"])
        return out
    if path.suffix == ".tsv":
        return [line.rsplit("\t", 1)[0] for line in lines]
    return lines


# ---------------------------------------------------------------------- labels
def _names(label: Any, task: str, where: str) -> list[str]:
    """The label names of one example (several for multilabel and tokens)."""
    if task == "multilabel":
        items = label if isinstance(label, list) else [s for s in str(label).split(",") if s.strip()]
    elif task == "tokens":
        items = label if isinstance(label, list) else str(label).split()
    else:
        if isinstance(label, (list, dict)):
            raise UsageError(f"{where}: label {label!r}: expected one label for head.task={task!r}")
        items = [label]
    return [str(x).strip() for x in items]


def label_names(examples: Sequence[Example], task: str, where: str = "data.labels") -> list[str]:
    """The sorted label vocabulary of the training examples (nothing for regression)."""
    if task == "regress":
        return []
    names = sorted({n for _, label in examples for n in _names(label, task, where)})
    if len(names) < 2 and task != "multilabel":
        raise UsageError(f"{where}: {len(names)} distinct label(s); expected at least 2 to classify")
    return names


def label_counts(examples: Sequence[Example], task: str, names: list[str]) -> list[int]:
    counts = Counter(n for _, label in examples for n in _names(label, task, "data.labels"))
    return [counts[n] for n in names]


def class_weights(spec: str, counts: list[int], names: list[str]) -> torch.Tensor | None:
    """``head.class_weights``: ``""`` none, ``"balanced"`` (n / (k * count), as scikit-learn),
    or ``"label=w,label=w"`` (unnamed labels weigh 1)."""
    if not spec:
        return None
    if spec == "balanced":
        n, k = sum(counts), len(counts)
        return torch.tensor([n / (k * max(c, 1)) for c in counts], dtype=torch.float32)
    weights = torch.ones(len(names))
    for item in spec.split(","):
        name, sep, value = item.rpartition("=")
        if not sep or name.strip() not in names:
            raise UsageError(f"head.class_weights={spec!r}: {item!r}: expected 'balanced' or label=weight "
                             f"with a label among {names[:10]}")
        try:
            weights[names.index(name.strip())] = float(value)
        except ValueError:
            raise UsageError(f"head.class_weights: {item!r}: expected a number after '='") from None
    return weights


# ---------------------------------------------------------------------- encoding
@dataclass
class LabelledBatch:
    """``tokens``/``mask`` (B, T), right-padded; ``targets``: class ids (B,), multi-hot
    (B, n_labels), per-token class ids (B, T) with ``IGNORE``, or values (B,)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    # Counted on the host before the move to the device, so the trainer's token counts
    # need no device sync (None: not counted yet).
    n_tokens: int | None = None  # real (unpadded) positions
    n_labelled: int | None = None  # integer targets other than IGNORE

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "LabelledBatch":
        n_tokens, n_labelled = self.n_tokens, self.n_labelled
        if self.tokens.device.type == "cpu":
            n_tokens = int(self.mask.sum()) if n_tokens is None else n_tokens
            if n_labelled is None and not self.targets.is_floating_point():
                n_labelled = int((self.targets != IGNORE).sum())
        moved = (t.to(device, non_blocking=non_blocking) for t in (self.tokens, self.mask, self.targets))
        return LabelledBatch(*moved, n_tokens=n_tokens, n_labelled=n_labelled)


class LabelledData:
    """Encoded examples of one split, with their targets, ready to batch."""

    def __init__(self, examples: Sequence[Example], tokenizer: Tokenizer, task: str, names: list[str],
                 max_len: int, where: str = "data.labels") -> None:
        if max_len < 3:
            raise UsageError(f"data.seq_len={max_len}: expected >= 3 (<s>, a token, </s>)")
        self.task, self.names, self.n = task, names, len(examples)
        index = {n: i for i, n in enumerate(names)}
        self.ids: list[list[int]] = []
        self.targets: list[Any] = []
        for j, (text, label) in enumerate(examples):
            here = f"{where}: example {j + 1}"
            if task == "tokens":
                ids, tags = encode_words(text, _names(label, task, here), tokenizer, index, max_len, here)
                self.ids.append(ids)
                self.targets.append(tags)
                continue
            self.ids.append(encode_text(text, tokenizer, max_len))
            if task == "regress":
                try:
                    self.targets.append(float(label))
                except (TypeError, ValueError):
                    raise UsageError(f"{here}: label {label!r}: expected a number for head.task='regress'") from None
            else:
                found = _names(label, task, here)
                unknown = [n for n in found if n not in index]
                if unknown:
                    raise UsageError(f"{here}: label {unknown[0]!r} is not among the training labels {names[:10]}")
                self.targets.append([index[n] for n in found] if task == "multilabel" else index[found[0]])

    def __len__(self) -> int:
        return self.n

    def batch(self, rows: Sequence[int]) -> LabelledBatch:
        ids = [self.ids[i] for i in rows]
        tokens, mask = pad(ids)
        if self.task == "tokens":
            targets = torch.full(tokens.shape, IGNORE, dtype=torch.long)
            for r, i in enumerate(rows):
                targets[r, : len(self.targets[i])] = torch.tensor(self.targets[i])
        elif self.task == "multilabel":
            targets = torch.zeros(len(rows), len(self.names))
            for r, i in enumerate(rows):
                targets[r, self.targets[i]] = 1.0
        elif self.task == "regress":
            targets = torch.tensor([self.targets[i] for i in rows], dtype=torch.float32)
        else:
            targets = torch.tensor([self.targets[i] for i in rows], dtype=torch.long)
        return LabelledBatch(tokens, mask, targets)

    def batches(self, batch_size: int) -> list[LabelledBatch]:
        """Every example once, in order."""
        return [self.batch(range(i, min(i + batch_size, self.n))) for i in range(0, self.n, batch_size)]


def encode_text(text: str, tokenizer: Tokenizer, max_len: int) -> list[int]:
    """``<s> text </s>``, the text cut to fit ``max_len`` ids."""
    return [BOS_ID, *tokenizer.encode(text)[: max_len - 2], EOS_ID]


def encode_words(text: str, tags: list[str], tokenizer: Tokenizer, index: dict[str, int], max_len: int,
                 where: str) -> tuple[list[int], list[int]]:
    """Ids of ``<s> w1 w2 ... </s>`` and per-id targets: a word's label on its first id."""
    words = text.split()
    if len(words) != len(tags):
        raise UsageError(f"{where}: {len(words)} words but {len(tags)} labels; expected one label per word")
    ids, targets = [BOS_ID], [IGNORE]
    for k, (word, tag) in enumerate(zip(words, tags)):
        if tag not in index:
            raise UsageError(f"{where}: label {tag!r} is not among the training labels {list(index)[:10]}")
        piece = tokenizer.encode(word if k == 0 else " " + word)
        ids += piece
        targets += [index[tag]] + [IGNORE] * (len(piece) - 1)
    ids, targets = ids[: max_len - 1] + [EOS_ID], targets[: max_len - 1] + [IGNORE]
    return ids, targets


def pad(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and their mask (True for real tokens)."""
    T = max(len(r) for r in rows)
    tokens = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens, tokens != PAD_ID


def split_examples(examples: list[Example], val_fraction: float, where: str) -> tuple[list[Example], list[Example]]:
    """A ``val_fraction`` of the examples held out (at least one), drawn by a fixed seed so a
    file sorted by label still gives both splits every label."""
    order = list(range(len(examples)))
    random.Random(0).shuffle(order)
    examples = [examples[i] for i in order]
    n_val = max(1, int(len(examples) * val_fraction))
    if n_val >= len(examples):
        raise UsageError(f"{where}: {len(examples)} examples leave none for training after holding out {n_val}")
    return examples[:-n_val], examples[-n_val:]
