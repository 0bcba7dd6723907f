"""``blockformer predict --checkpoint DIR --input FILE``: labels and probabilities for texts.

The input is one text per line, a TSV file (``.tsv``: the text before the last tab, so a
labelled file can be predicted as it is) or JSONL (the ``"text"`` field). A checkpoint
trained on text pairs (``data.text_pair``) reads pairs: ``text<TAB>pair`` lines (a
``.tsv`` label column is dropped) or JSONL with ``"text"`` and that key, encoded and given
segment ids as in training; each record then carries both texts. The output is
one JSON object per input, in order: ``{"text", "label", "probs": {label: p}}`` for
classification; ``"labels"`` (those above 0.5) for multilabel; ``"value"`` for regression;
for token classification, ``"words"`` with one label and probability each. ``--format tsv``
writes ``label<TAB>probability`` (``value`` for regression) instead.

A model that reads images or signals (``model.input`` patches or frames) takes PNG files or
directories of them (``--input``), or a split of its data set (``--split test``); see
``predict_arrays.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a task-head checkpoint or run directory")
    parser.add_argument("--input", nargs="+", metavar="FILE",
                        help="texts: lines, .tsv or .jsonl; images: PNG files or directories of them")
    parser.add_argument("--split", choices=["train", "val", "test"],
                        help="images/signals: predict this split of the run's data set, with its accuracy")
    parser.add_argument("--beam", type=int, default=1, metavar="K", help="image-to-text: beam size (1 = greedy)")
    parser.add_argument("--output", metavar="FILE", help="where to write (default: stdout)")
    parser.add_argument("--format", default="jsonl", choices=["jsonl", "tsv"])
    parser.add_argument("--batch-size", type=int, default=64, metavar="B")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])


def run(args: argparse.Namespace) -> int:
    from ..data.labelled import read_texts  # noqa: PLC0415
    from ..train.load import load_checkpoint  # noqa: PLC0415
    from ..precision import resolve_device  # noqa: PLC0415

    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: expected an integer >= 1")
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device)
    if ckpt.config.model.input != "tokens":
        from .predict_arrays import run_arrays  # noqa: PLC0415

        return run_arrays(args, ckpt, device)
    if not args.input or len(args.input) != 1 or args.split:
        raise UsageError("--input: expected one text file (--split is for models reading images or signals)")
    if ckpt.config.head.task == "none":
        raise UsageError(f"--checkpoint {args.checkpoint}: has no task head; expected a checkpoint trained on "
                         "data.labels with [head] task set")
    texts = read_texts(args.input[0], ckpt.config.data.text_pair)
    records = predict(ckpt, texts, args.batch_size, device)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for r in records:
            out.write(json.dumps(r, ensure_ascii=False) + "\n" if args.format == "jsonl" else _tsv(r) + "\n")
    finally:
        if args.output:
            out.close()
    return 0


def _tsv(record: dict[str, Any]) -> str:
    if "value" in record:
        return f"{record['value']:.6g}"
    if "words" in record:
        return " ".join(w["label"] for w in record["words"])
    if "labels" in record:
        return ",".join(record["labels"])
    return f"{record['label']}\t{record['probs'][record['label']]:.6f}"


def predict(ckpt: Any, texts: list[Any], batch_size: int = 64, device: Any = "cpu") -> list[dict[str, Any]]:
    """One record per text, or per text pair (see the module docstring), from a loaded
    task-head checkpoint."""
    import torch  # noqa: PLC0415

    from ..data.labelled import IGNORE, encode_example, encode_words, pad  # noqa: PLC0415
    from ..data.describe import pair_segments  # noqa: PLC0415
    from ..train.classify import probabilities  # noqa: PLC0415

    cfg = ckpt.config
    task, names = cfg.head.task, cfg.head.labels
    max_len = min(cfg.data.seq_len, cfg.model.max_seq_len)
    records = []
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        segments: dict[str, torch.Tensor] = {}
        if task == "tokens":  # any known label stands in: only the word boundaries matter here
            encoded = [encode_words(t, [names[0]] * len(t.split()), ckpt.tokenizer, {names[0]: 0}, max_len, "--input")
                       for t in chunk]
            ids = [e[0] for e in encoded]
        else:
            ids, types = zip(*(encode_example(t, ckpt.tokenizer, max_len) for t in chunk))
            if cfg.data.text_pair and pair_segments(cfg.model):  # segment ids as in training
                segments = {"token_types": pad(types)[0].to(device)}
        tokens, mask = pad(ids)
        with torch.no_grad():
            out = ckpt.model(tokens.to(device), attention_mask=mask.to(device), **segments)
            probs = probabilities(task, out).cpu()
        for j, text in enumerate(chunk):
            pair = isinstance(text, tuple)
            record: dict[str, Any] = {"text": text[0], cfg.data.text_pair: text[1]} if pair else {"text": text}
            p = probs[j]
            if task == "regress":
                record["value"] = float(p)
            elif task == "multilabel":
                record["labels"] = [n for n, q in zip(names, p.tolist()) if q > 0.5]
                record["probs"] = {n: round(q, 6) for n, q in zip(names, p.tolist())}
            elif task == "tokens":
                firsts = [k for k, t in enumerate(encoded[j][1]) if t != IGNORE]
                words = text.split()
                record["words"] = [
                    {"word": w, "label": names[int(p[k].argmax())], "prob": round(float(p[k].max()), 6)}
                    for w, k in zip(words, firsts)
                ]
            else:
                record["label"] = names[int(p.argmax())]
                record["probs"] = {n: round(q, 6) for n, q in zip(names, p.tolist())}
            records.append(record)
    return records
