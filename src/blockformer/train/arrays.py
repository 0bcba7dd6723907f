"""Objectives for inputs that are arrays, not token ids: images and continuous signals.

``data.dataset`` names a data set a Python package ships (nothing is downloaded):

- ``digits`` (scikit-learn, 8x8 images; ``model.input = "patches"``): a class per image,
  through a task head (``[head] task = "classify"``), trained on shifted images;
- ``digit-strings`` (the same digits, 1..``data.max_digits`` side by side): an
  encoder-decoder reads the patches and writes the digit string; exact match is measured by
  greedy decoding through the generation code and its KV cache;
- ``japanese-vowels`` (sktime; ``model.input = "frames"``, 12 coefficients a frame): the
  speaker of each utterance, through a task head.

The data objects follow ``LabelledData``'s interface and the objectives are ``TaskHead`` and
``Seq2Seq`` with their batches drawn here, so the loop, checkpoints, metrics and ``eval``
work as for text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ..schema import suggest
from ..data.frames import load_vowels_split, pad_frames
from ..data.images import DIGIT_SIZE, affine, digit_strings, load_digits_split, pad_images, shift
from ..data.labelled import LabelledBatch
from ..data.seq2seq import Seq2SeqBatch, collate_pairs
from ..errors import UsageError
from ..generate import greedy_decode
from ..run_config import RunConfig
from .classify import TaskHead
from .objective import Seq2Seq

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
    from ..tokenizers import CharTokenizer, train_tokenizer  # noqa: PLC0415

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


class ArrayHead(TaskHead):
    """``TaskHead`` whose training batches are augmented with the objective's own generator
    (saved with the checkpoint, so a resumed run draws the same shifts)."""

    def next_batch(self) -> LabelledBatch:
        rows = torch.randint(len(self.train), (self.batch_size,), generator=self.generator).tolist()
        return self.train.batch(rows, self.generator).to(self.device, non_blocking=True)


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


class ImageToText(Seq2Seq):
    """``Seq2Seq`` on digit-string images: loss on fixed held-out batches, and exact match
    of the greedy decoding of the held-out images."""

    def __init__(self, train: DigitStrings, val: DigitStrings, n_heldout: int, device: torch.device,
                 seed: int = 0) -> None:
        images, texts = val.heldout(n_heldout)
        B = train.batch_size
        val_batches = [val.collate(images[i : i + B], texts[i : i + B]) for i in range(0, len(texts), B)]
        self.train, self.val_batches, self.device = train, val_batches, device
        self.heldout_images, self.heldout_texts = images, texts
        self.task, self.tokenizer = "digit-strings", train.tokenizer
        self.generator = torch.Generator().manual_seed(seed)
        self._stream = None  # batches are drawn with the generator (Seq2Seq's state handling)
        self.buckets = None  # images come in one shape; only text targets would need buckets

    @torch.no_grad()
    def exact_match(self, model: nn.Module, n: int, batch_size: int = 64) -> float:
        predictions = decode_images(model, self.tokenizer, self.heldout_images[:n], self.train.patch_size, batch_size)
        truth = self.heldout_texts[:n]
        return sum(p == t for p, t in zip(predictions, truth)) / max(len(truth), 1)


def decode_images(model: nn.Module, tokenizer: Any, images: list[torch.Tensor], patch_size: int,
                  batch_size: int = 64, beam: int = 1) -> list[str]:
    """The text an image-to-text encoder-decoder writes for each image (greedy, or beam
    search with ``beam`` > 1), through the KV cache; at most 2 tokens per patch column."""
    from ..generate import beam_search  # noqa: PLC0415

    out = []
    for i in range(0, len(images), batch_size):
        src, mask = pad_images(images[i : i + batch_size], patch_size)
        limit = src.shape[-1] // patch_size * 2 + 1
        if beam > 1:
            ids = [h[0].tokens for h in beam_search(model, src, mask, beam_size=beam, max_len=limit)]
        else:
            ids = greedy_decode(model, src, mask, max_len=limit)
        out.extend(tokenizer.decode(row) for row in ids)
    return out


# ---------------------------------------------------------------------- the builder
def build_array_objective(cfg: RunConfig, tokenizer: Any, device: torch.device, log: Any = print) -> Any:
    """The objective of a ``data.dataset`` run (see the module docstring)."""
    check_dataset(cfg)
    tc = cfg.train
    if DATASETS[cfg.data.dataset][1] == "seq2seq":
        train = DigitStrings("train", cfg, tokenizer, tc.batch_size, train=True)
        val = DigitStrings("val", cfg, tokenizer, tc.batch_size, train=False)
        log(f"data: digit strings of 1-{cfg.data.max_digits} digits from {len(train.labels):,} training digits; "
            f"{cfg.data.heldout} held-out strings from {len(val.labels)} validation digits")
        return ImageToText(train, val, cfg.data.heldout, device, seed=tc.seed)
    train, val = array_data(cfg, "train", train=True), array_data(cfg, "val")
    log(f"data: {cfg.data.dataset}, {len(train):,} training examples, {len(val):,} held out for validation, "
        f"{len(train.names)} classes" + (f"; shifts up to {cfg.data.shift} px, rotations up to {cfg.data.rotate} deg, "
                                          f"scale +-{cfg.data.zoom}" if train.augment else ""))
    return ArrayHead(train, val, tc.batch_size, tc.seed, device)
