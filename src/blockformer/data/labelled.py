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

Text pairs (``data.text_pair``: natural-language inference, cross-encoders, question +
passage) take their second text from that JSONL key, or from a middle TSV column
(``text<TAB>pair<TAB>label``), and are encoded as BERT encodes them: ``<s> a </s> b </s>``
with segment ids 0 for ``<s> a </s>`` and 1 for ``b </s>`` (padding 0), the longer text
cut first when the pair does not fit. The segment ids are kept for a model that reads them
(``token_types=True``: an encoder with a segment table).
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
Text = str | tuple[str, str]  # one text, or a pair (data.text_pair)
Example = tuple[Text, Any]  # (text, raw label)


def is_jsonl(path: Path, first_line: str) -> bool:
    return path.suffix in (".jsonl", ".json") or first_line.lstrip().startswith("{")


def read_labelled(path: str | Path, text_pair: str = "") -> list[Example]:
    """``(text, label)`` of every non-empty line of a labelled file (see the module docstring);
    with ``text_pair`` (``data.text_pair``), ``text`` is the pair ``(text, second text)``."""
    path = Path(path)
    columns = "text<TAB>pair<TAB>label" if text_pair else "text<TAB>label"
    keys = f"\"text\", \"{text_pair}\" and \"label\"" if text_pair else "\"text\" and \"label\""
    lines = _read_lines(path, f"{columns} lines or JSONL with {keys}")
    lines_nonempty = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not lines_nonempty:
        raise UsageError(f"{path}: empty file; expected {columns} lines or JSONL")
    jsonl = is_jsonl(path, lines_nonempty[0][1])
    examples = []
    for i, line in lines_nonempty:
        if jsonl:
            record = _json_record(path, i, line)
            if not isinstance(record, dict) or "label" not in record:
                raise UsageError(f"{path}:{i}: expected a JSON object with {keys}")
            examples.append((_json_text(record, text_pair, f"{path}:{i}"), record["label"]))
        else:
            if line.count("\t") < 1 + bool(text_pair):
                found = "one tab" if "\t" in line else "no tab"
                raise UsageError(f"{path}:{i}: {found}; expected {columns}"
                                 + (f" (data.text_pair={text_pair!r}: text pairs)" if text_pair else ""))
            *texts, label = line.rsplit("\t", 1 + bool(text_pair))
            examples.append((tuple(texts) if text_pair else texts[0], label))
    return examples


def read_texts(path: str | Path, text_pair: str = "") -> list[Text]:
    """Texts to predict: JSONL ``"text"`` fields, the text before the last tab of a TSV line,
    or whole lines of any other file. With ``text_pair``, pairs: the JSONL ``"text"`` and
    ``text_pair`` fields, or ``text<TAB>pair`` lines (a ``.tsv`` line's label after a
    further tab is dropped, so a labelled file can be predicted as it is)."""
    path = Path(path)
    lines = [line for line in _read_lines(path, "one text per line, TSV or JSONL") if line.strip()]
    if not lines:
        raise UsageError(f"{path}: empty file; expected one text per line, TSV or JSONL")
    if is_jsonl(path, lines[0]):
        return [_json_text(_json_record(path, i, line), text_pair, f"{path}:{i}") for i, line in enumerate(lines, 1)]
    if text_pair:
        pairs = []
        for i, line in enumerate(lines, 1):
            if "\t" not in line:
                raise UsageError(f"{path}:{i}: no tab; expected text<TAB>pair lines (the checkpoint classifies "
                                 f"text pairs: data.text_pair={text_pair!r})")
            cut = 2 if path.suffix == ".tsv" and line.count("\t") >= 2 else 1
            pairs.append(tuple(line.rsplit("\t", cut)[:2]))
        return pairs
    if path.suffix == ".tsv":
        return [line.rsplit("\t", 1)[0] for line in lines]
    return lines


def _json_record(path: Path, i: int, line: str) -> Any:
    try:
        return loads_json(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{i}: not valid JSON ({e.msg})") from None


def _json_text(record: Any, text_pair: str, where: str) -> Text:
    """A JSON record's ``"text"`` string, or with ``text_pair`` its pair of strings."""
    for key in ("text", text_pair) if text_pair else ("text",):
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            what = " (data.text_pair: the second text)" if key == text_pair else ""
            raise UsageError(f"{where}: expected a JSON object with a \"{key}\" string{what}")
    return (record["text"], record[text_pair]) if text_pair else record["text"]


def texts_of(text: Text) -> tuple[str, ...]:
    """The one or two strings of an example's text (what a tokenizer trains on)."""
    return text if isinstance(text, tuple) else (text,)


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
    (B, n_labels), per-token class ids (B, T) with ``IGNORE``, or values (B,);
    ``token_types`` (B, T): segment ids of text pairs, for a model that reads them (else None)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    # Counted on the host before the move to the device, so the trainer's token counts
    # need no device sync (None: not counted yet).
    n_tokens: int | None = None  # real (unpadded) positions
    n_labelled: int | None = None  # integer targets other than IGNORE
    token_types: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "LabelledBatch":
        n_tokens, n_labelled = self.n_tokens, self.n_labelled
        if self.tokens.device.type == "cpu":
            n_tokens = int(self.mask.sum()) if n_tokens is None else n_tokens
            if n_labelled is None and not self.targets.is_floating_point():
                n_labelled = int((self.targets != IGNORE).sum())
        moved = (t.to(device, non_blocking=non_blocking) for t in (self.tokens, self.mask, self.targets))
        types = None if self.token_types is None else self.token_types.to(device, non_blocking=non_blocking)
        return LabelledBatch(*moved, n_tokens=n_tokens, n_labelled=n_labelled, token_types=types)


class LabelledData:
    """Encoded examples of one split, with their targets, ready to batch. ``token_types``:
    text pairs' batches carry their segment ids (for a model with a segment table)."""

    def __init__(self, examples: Sequence[Example], tokenizer: Tokenizer, task: str, names: list[str],
                 max_len: int, where: str = "data.labels", *, token_types: bool = False) -> None:
        pairs = any(isinstance(text, tuple) for text, _ in examples)
        if max_len < 3 + 2 * pairs:
            raise UsageError(f"data.seq_len={max_len}: expected >= " + (
                "5 for text pairs (<s>, a token, </s>, a token, </s>)" if pairs else "3 (<s>, a token, </s>)"))
        self.task, self.names, self.n = task, names, len(examples)
        index = {n: i for i, n in enumerate(names)}
        self.ids: list[list[int]] = []
        self.types: list[list[int]] | None = [] if pairs and token_types else None
        self.targets: list[Any] = []
        for j, (text, label) in enumerate(examples):
            here = f"{where}: example {j + 1}"
            if task == "tokens":
                if isinstance(text, tuple):
                    raise UsageError(f"{here}: a text pair; head.task='tokens' labels the words of one text "
                                     f"(expected no data.text_pair)")
                ids, tags = encode_words(text, _names(label, task, here), tokenizer, index, max_len, here)
                self.ids.append(ids)
                self.targets.append(tags)
                continue
            ids, types = encode_example(text, tokenizer, max_len)
            self.ids.append(ids)
            if self.types is not None:
                self.types.append(types)
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
        # Segment ids pad like ids, with 0 (PAD_ID): segment 0, as Hugging Face pads token_type_ids.
        types = None if self.types is None else pad([self.types[i] for i in rows])[0]
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
        return LabelledBatch(tokens, mask, targets, token_types=types)

    def batches(self, batch_size: int) -> list[LabelledBatch]:
        """Every example once, in order."""
        return [self.batch(range(i, min(i + batch_size, self.n))) for i in range(0, self.n, batch_size)]


def encode_text(text: str, tokenizer: Tokenizer, max_len: int) -> list[int]:
    """``<s> text </s>``, the text cut to fit ``max_len`` ids."""
    return [BOS_ID, *tokenizer.encode(text)[: max_len - 2], EOS_ID]


def encode_pair(a: str, b: str, tokenizer: Tokenizer, max_len: int) -> tuple[list[int], list[int]]:
    """Ids of ``<s> a </s> b </s>`` and their segment ids (0 up to the first ``</s>``, then 1),
    as BERT encodes a pair; the longer text is cut first to fit ``max_len`` ids."""
    ta, tb = truncate_pair(tokenizer.encode(a), tokenizer.encode(b), max_len - 3)
    return [BOS_ID, *ta, EOS_ID, *tb, EOS_ID], [0] * (len(ta) + 2) + [1] * (len(tb) + 1)


def truncate_pair(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """``a`` and ``b`` cut to ``budget`` ids in all, longest first (BERT's tokenizers'
    default): the longer loses its last id until they are equal, then they take turns, ``b``
    first, so neither loses more than it must."""
    la, lb = len(a), len(b)
    excess = la + lb - budget
    if excess > 0:
        cut = min(excess, abs(la - lb))  # from the longer alone
        la, lb = (la - cut, lb) if la > lb else (la, lb - cut)
        rest = excess - cut  # then from both in turn
        la, lb = la - rest // 2, lb - (rest - rest // 2)
    return a[:la], b[:lb]


def encode_example(text: Text, tokenizer: Tokenizer, max_len: int) -> tuple[list[int], list[int]]:
    """One text's ids (segment ids all 0) or a pair's ids and segment ids, fitted to ``max_len``."""
    if isinstance(text, tuple):
        return encode_pair(*text, tokenizer, max_len)
    ids = encode_text(text, tokenizer, max_len)
    return ids, [0] * len(ids)


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
