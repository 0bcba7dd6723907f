"""``blockformer predict`` for models that read images or signals instead of text.

Inputs: PNG files (or directories of them, read in name order) given to ``--input``, or a
split of the run's data set (``--split test``: the held-out images or utterances, with the
truth, and the accuracy on stderr). Frames are predicted from a split only: a file of
frames would need the training set's standardisation.

One JSON object per input: ``{"input", "label", "probs"}`` for a classification head (and
``"truth"`` for a split); ``{"input", "text"}`` for an image-to-text encoder-decoder, which
decodes through the generation code (greedy, or ``--beam K``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError


def image_files(items: list[str]) -> list[Path]:
    """``--input`` items: image files, and the ``*.png`` files of directories (sorted)."""
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.png"))
            if not found:
                raise UsageError(f"{path}: no .png files in this directory")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such file or directory; expected PNG files or directories of them")
    return files


def load_pngs(files: list[Path], cfg: Any) -> list[torch.Tensor]:
    """Each file as a (1, image_height, W) image: W = image_width for a classifier; for an
    image-to-text model, the file's aspect ratio kept, in whole patches (at most image_width)."""
    from PIL import Image  # noqa: PLC0415

    from ..data.images import read_png  # noqa: PLC0415

    m = cfg.model
    if m.image_channels != 1:
        raise UsageError(f"model.image_channels={m.image_channels}: PNG input is read as grey; expected 1")
    out = []
    for f in files:
        width = m.image_width
        if m.arch == "encoder-decoder":
            try:
                with Image.open(f) as im:
                    w, h = im.size
            except OSError as e:
                raise UsageError(f"{f}: not an image Pillow can read ({e})") from None
            cols = max(1, round(m.image_height * w / h / m.patch_size))
            width = min(m.image_width, cols * m.patch_size)
        out.append(read_png(f, m.image_height, width))
    return out


def run_arrays(args: argparse.Namespace, ckpt: Any, device: Any) -> int:
    from ..data.arrays import DigitStrings, array_data  # noqa: PLC0415
    from ..train.arrays import decode_images  # noqa: PLC0415
    from ..train.classify import probabilities  # noqa: PLC0415

    cfg = ckpt.config
    if bool(args.input) == bool(args.split):
        raise UsageError("--input/--split: expected image files (--input) or a split of the data set (--split), one of them")
    if args.beam < 1:
        raise UsageError(f"--beam {args.beam}: expected an integer >= 1")
    names = [str(p) for p in image_files(args.input)] if args.input else []
    if args.input and cfg.model.input != "patches":
        raise UsageError(f"--input: model.input={cfg.model.input!r} predicts a split only; expected --split")
    truth: list[str] | None = None
    records: list[dict[str, Any]] = []
    if cfg.model.arch == "encoder-decoder":  # image -> text
        if args.split:
            strings = DigitStrings(args.split, cfg, ckpt.tokenizer, args.batch_size, train=False)
            images, truth = strings.heldout(cfg.data.heldout)
            names = [f"{args.split}:{i}" for i in range(len(images))]
        else:
            images = load_pngs([Path(n) for n in names], cfg)
        texts = decode_images(ckpt.model, ckpt.tokenizer, images, cfg.model.patch_size, args.batch_size, args.beam)
        records = [{"input": n, "text": t} for n, t in zip(names, texts)]
        predicted = texts
    else:
        if cfg.head.task != "classify":
            raise UsageError(f"--checkpoint {args.checkpoint}: expected a classify head or an image-to-text model")
        if args.split:
            data = array_data(cfg, args.split)
            truth = [data.names[int(t)] for t in data.targets]
            names = [f"{args.split}:{i}" for i in range(len(data))]
            batches = data.batches(args.batch_size)
        else:
            from ..data.images import pad_images  # noqa: PLC0415

            images = load_pngs([Path(n) for n in names], cfg)
            batches = (pad_images(images[i : i + args.batch_size], cfg.model.patch_size)
                       for i in range(0, len(images), args.batch_size))
        probs = []
        with torch.no_grad():
            for batch in batches:
                x, mask = (batch.tokens, batch.mask) if hasattr(batch, "tokens") else batch
                probs.append(probabilities("classify", ckpt.model(x.to(device), attention_mask=mask.to(device))).cpu())
        p_all = torch.cat(probs)
        labels = cfg.head.labels
        predicted = [labels[int(p.argmax())] for p in p_all]
        records = [{"input": n, "label": lab, "probs": {k: round(q, 6) for k, q in zip(labels, p.tolist())}}
                   for n, lab, p in zip(names, predicted, p_all)]
    if truth is not None:
        for r, t in zip(records, truth):
            r["truth"] = t
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for r in records:
            if args.format == "jsonl":
                out.write(json.dumps(r, ensure_ascii=False) + "\n")
            else:
                out.write(f"{r['input']}\t{r.get('text', r.get('label'))}\n")
    finally:
        if args.output:
            out.close()
    if truth is not None:
        right = sum(p == t for p, t in zip(predicted, truth))
        what = "exact match" if cfg.model.arch == "encoder-decoder" else "accuracy"
        print(f"{what} {right / len(truth):.4f} ({right}/{len(truth)}) on the {args.split} split", file=sys.stderr)
    return 0
