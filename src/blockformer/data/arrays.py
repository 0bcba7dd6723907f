"""Data sets of arrays, not text: images and continuous signals a Python package ships.

``data.dataset`` names one (nothing is downloaded):

- ``digits`` (scikit-learn, 8x8 images; ``model.input = "patches"``): a class per image,
  through a task head (``[head] task = "classify"``), trained on shifted images;
- ``digit-strings`` (the same digits, 1..``data.max_digits`` side by side): an
  encoder-decoder reads the patches and writes the digit string;
- ``japanese-vowels`` (sktime; ``model.input = "frames"``, 12 coefficients a frame): the
  speaker of each utterance, through a task head.

``ArrayData`` follows ``LabelledData``'s interface and ``DigitStrings`` draws
``Seq2SeqBatch``es, so the task-head and sequence-to-sequence objectives (train/arrays.py)
read them as they read text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..errors import UsageError
from ..run_config import RunConfig
from ..schema import suggest
from ..tokenizers import CharTokenizer, train_tokenizer
from .frames import load_vowels_split, pad_frames
from .images import DIGIT_SIZE, affine, digit_strings, load_digits_split, pad_images, shift
from .labelled import LabelledBatch
from .seq2seq import Seq2SeqBatch, collate_pairs

# name -> (model.input, what is learned, label names)
DATASETS: dict[str, tuple[str, str, list[str]]] = {
    "digits": ("patches", "classify", [str(d) for d in range(10)]),
    "digit-strings": ("patches", "seq2seq", []),
    "japanese-vowels": ("frames", "classify", [str(s) for s in range(1, 10)]),  # speakers 1..9
}
DIGIT_CHARS = "0123456789"


def check_dataset(cfg: RunConfig) -> None:
    """``data.dataset`` against ``[model]`` and ``[head]``: one line naming what does not fit."""
    data, model, head = cfg.data, cfg.model, cfg.head
    if data.dataset not in DATASETS:
        raise UsageError(f"data.dataset={data.dataset!r}: unknown{suggest(data.dataset, list(DATASETS))}; "
                         f"expected one of {', '.join(DATASETS)}")
    needs, learns, _ = DATASETS[data.dataset]
    if model.input != needs:
        raise UsageError(f"model.input={model.input!r}: data.dataset={data.dataset!r} is read as {needs}; "
                         f"expected model.input={needs!r}")
    if needs == "patches":
        width = DIGIT_SIZE * (data.max_digits if learns == "seq2seq" else 1)
        for name, want in (("image_channels", 1), ("image_height", DIGIT_SIZE), ("image_width", width)):
            if getattr(model, name) != want:
                raise UsageError(f"model.{name}={getattr(model, name)}: data.dataset={data.dataset!r} "
                                 f"needs {want}")
    if needs != "patches" and data.augmentation:
        raise UsageError(f"{data.augmentation}: augments images; data.dataset={data.dataset!r} is read as "
                         f"{needs}; expected 0")
    if needs == "frames" and model.frame_dim != 12:
        raise UsageError(f"model.frame_dim={model.frame_dim}: japanese-vowels frames have 12 coefficients; expected 12")
    if learns == "classify" and head.task != "classify":
        raise UsageError(f"head.task={head.task!r}: data.dataset={data.dataset!r} is classified; expected 'classify'")
    if learns == "seq2seq" and (model.arch != "encoder-decoder" or head.task != "none"):
        raise UsageError(f"model.arch={model.arch!r}, head.task={head.task!r}: digit-strings are written by a "
                         f"decoder; expected model.arch='encoder-decoder' and no [head] task")


def dataset_labels(cfg: RunConfig) -> list[str]:
    return list(DATASETS[cfg.data.dataset][2])


def dataset_tokenizer(cfg: RunConfig) -> Any:
    """The decoder's characters for digit-strings; for a head, the byte tokenizer (unused:
    no text goes in or out, but every checkpoint carries one)."""
    if DATASETS[cfg.data.dataset][1] == "seq2seq":
        return CharTokenizer(DIGIT_CHARS)
    return train_tokenizer("byte", [])


# ---------------------------------------------------------------------- classification
class ArrayData:
    """Images or signals of one split with class ids, batched like ``LabelledData``:
    ``LabelledBatch.tokens`` holds the images (B, C, H, W) or frames (B, T, F) and
    ``mask`` their real patches or frames."""

    def __init__(self, inputs: list[torch.Tensor], targets: torch.Tensor, names: list[str],
                 collate: Callable[[list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
                 augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None) -> None:
        self.inputs, self.targets, self.names = inputs, targets, names
        self.collate, self.augment = collate, augment
        self.task = "classify"

    def __len__(self) -> int:
        return len(self.inputs)

    def batch(self, rows: list[int], generator: torch.Generator | None = None) -> LabelledBatch:
        x, mask = self.collate([self.inputs[r] for r in rows])
        if generator is not None and self.augment is not None:
            x = self.augment(x, generator)
        return LabelledBatch(x, mask, self.targets[rows])

    def batches(self, batch_size: int):
        for i in range(0, len(self), batch_size):
            yield self.batch(list(range(i, min(i + batch_size, len(self)))))


def augment_digits(cfg: RunConfig) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None:
    """The training augmentation ``[data]`` asks for: rotation and scaling (``rotate``,
    ``zoom``), then a shift of up to ``shift`` pixels into the empty border; None if none."""
    d = cfg.data
    if not d.augmentation:
        return None
    return lambda x, g: shift(affine(x, d.rotate, d.zoom, g), d.shift, g)


def array_data(cfg: RunConfig, split: str, train: bool = False) -> ArrayData:
    """``split`` (train, val or test) of ``data.dataset`` as ``ArrayData``; training images
    are augmented as ``augment_digits`` says."""
    names = dataset_labels(cfg)
    if cfg.data.dataset == "japanese-vowels":
        series, labels = load_vowels_split(split)
        return ArrayData(series, labels, names, pad_frames)
    images, labels = load_digits_split(split)
    P = cfg.model.patch_size
    augment = augment_digits(cfg) if train else None
    return ArrayData(list(images), labels, names, lambda ims: pad_images(ims, P), augment)


# ---------------------------------------------------------------------- image -> text
class DigitStrings:
    """Images of digit strings from one split's digits, batched for an encoder-decoder:
    ``src`` the images (B, 1, 8, W) right-padded, ``src_mask`` their real patches. Training
    strings are augmented digit by digit (``augment_digits``: each digit is shifted, turned
    and scaled within its own 8-pixel slot, as each character of handwriting varies)."""

    def __init__(self, split: str, cfg: RunConfig, tokenizer: Any, batch_size: int, train: bool) -> None:
        self.images, self.labels = load_digits_split(split)
        self.max_digits, self.patch_size = cfg.data.max_digits, cfg.model.patch_size
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.augment = augment_digits(cfg) if train else None

    def make(self, n: int, generator: torch.Generator) -> tuple[list[torch.Tensor], list[str]]:
        images, texts = digit_strings(self.images, self.labels, n, self.max_digits, generator)
        if self.augment is not None:
            S = DIGIT_SIZE
            slots = torch.cat([im.reshape(1, S, -1, S).permute(2, 0, 1, 3) for im in images])  # (digits, 1, S, S)
            slots = self.augment(slots, generator).split([im.shape[-1] // S for im in images])
            images = [d.permute(1, 2, 0, 3).reshape(1, S, -1) for d in slots]  # back to (1, S, S * k)
        return images, texts

    def collate(self, images: list[torch.Tensor], texts: list[str]) -> Seq2SeqBatch:
        src, src_mask = pad_images(images, self.patch_size)
        batch = collate_pairs([([], self.tokenizer.encode(t)) for t in texts])  # targets: bos/eos/padding
        return dataclasses.replace(batch, src=src, src_mask=src_mask, num_tokens=batch.num_tokens)

    def sample(self, generator: torch.Generator) -> Seq2SeqBatch:
        return self.collate(*self.make(self.batch_size, generator))

    def heldout(self, n: int, seed: int = 0) -> tuple[list[torch.Tensor], list[str]]:
        """A fixed set of ``n`` strings (the same for every run and every evaluation)."""
        return self.make(n, torch.Generator().manual_seed(seed))
