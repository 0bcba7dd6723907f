"""Images: scikit-learn's 8x8 handwritten digits, their fixed splits, shifts, strings of digits, PNG files.

The digits (1,797 images of 8x8 pixels, grey levels 0..16, ten classes; the UCI "optical
recognition of handwritten digits" test set) ship inside scikit-learn, so nothing is
downloaded. Pixels are scaled to [0, 1]. The splits are fixed: 360 test images (20%,
stratified, ``random_state=0``), then 10% of the rest for validation (what the trainer
evaluates and keeps its best checkpoint by), leaving 1,293 for training.

Augmentation that suits 8x8 digits: shifts of up to a pixel or two (``shift``) into the
empty border, so no stroke is cut; small rotations and changes of scale (``affine``: a few
degrees, a few percent, as handwriting varies; the elastic/affine distortions of Simard et
al. 2003); never flips or large rotations, which would turn a 6 into a 9 or a 2 into a
mirror glyph.

``digit_strings`` puts 1..k digits of a split side by side (8 x 8k pixels, the image as
wide as its string), the task an encoder reading patches and a decoder writing the digit
string learn together.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UsageError

DIGIT_SIZE = 8
SPLITS = ("train", "val", "test")


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    try:
        from sklearn.datasets import load_digits  # noqa: PLC0415
        from sklearn.model_selection import train_test_split  # noqa: PLC0415
    except ImportError:  # pragma: no cover - scikit-learn is in the [data] extra
        raise UsageError("data.dataset='digits' needs scikit-learn: pip install 'blockformer[data]'") from None
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)  # (1797, 8, 8) in [0, 1]
    labels = data.target.astype(np.int64)
    index = np.arange(len(labels))
    rest, test = train_test_split(index, test_size=0.2, stratify=labels, random_state=0)
    train, val = train_test_split(rest, test_size=0.1, stratify=labels[rest], random_state=0)
    return images, labels, {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def load_digits_split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, 1, 8, 8) float in [0, 1], labels (N,)) of ``split``: train, val or test."""
    if split not in SPLITS:
        raise UsageError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    images, labels, splits = _digits()
    rows = splits[split]
    return torch.from_numpy(images[rows])[:, None], torch.from_numpy(labels[rows])


def shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Each image moved by a random whole number of pixels, at most ``max_shift`` along each
    axis and never further than its empty border reaches: no stroke leaves the frame (the
    digits are scaled to fill their 8x8 box, so a blind shift would cut many). The
    uncovered border is filled with 0 (background)."""
    if max_shift <= 0:
        return images
    B, C, H, W = images.shape
    ink_rows = (images > 0).any(dim=1).any(dim=2)  # (B, H)
    ink_cols = (images > 0).any(dim=1).any(dim=1)  # (B, W)
    out = torch.zeros_like(images)
    u = torch.rand(B, 2, generator=generator).tolist()
    for b in range(B):
        r, c = ink_rows[b].nonzero().flatten(), ink_cols[b].nonzero().flatten()
        if len(r) == 0:
            out[b] = images[b]
            continue
        lo_y, hi_y = -min(max_shift, int(r[0])), min(max_shift, H - 1 - int(r[-1]))
        lo_x, hi_x = -min(max_shift, int(c[0])), min(max_shift, W - 1 - int(c[-1]))
        dy = lo_y + int(u[b][0] * (hi_y - lo_y + 1))  # uniform over the allowed moves
        dx = lo_x + int(u[b][1] * (hi_x - lo_x + 1))
        out[b] = torch.roll(images[b], shifts=(dy, dx), dims=(1, 2))  # only background wraps around
    return out


def affine(images: torch.Tensor, degrees: float, zoom: float, generator: torch.Generator) -> torch.Tensor:
    """Each image rotated about its centre by a random angle in [-``degrees``, ``degrees``]
    and scaled by a random factor in [1 - ``zoom``, 1 + ``zoom``] (``rotate_scale``)."""
    if degrees <= 0 and zoom <= 0:
        return images
    u = torch.rand(images.shape[0], 2, generator=generator) * 2 - 1  # uniform in [-1, 1)
    return rotate_scale(images, u[:, 0] * math.radians(degrees), 1 + u[:, 1] * zoom)


def rotate_scale(images: torch.Tensor, angles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) images rotated counter-clockwise by ``angles`` (B,) radians about their
    centre and scaled by ``scales`` (B,), resampled bilinearly; what comes in from outside
    the frame is background (0)."""
    cos, sin = torch.cos(angles) / scales, torch.sin(angles) / scales  # output -> input coordinates
    zero = torch.zeros_like(cos)
    theta = torch.stack([torch.stack([cos, -sin, zero], -1), torch.stack([sin, cos, zero], -1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta.to(images.dtype), list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


# ---------------------------------------------------------------------- strings of digits
def digit_strings(
    images: torch.Tensor, labels: torch.Tensor, n: int, max_digits: int, generator: torch.Generator
) -> tuple[list[torch.Tensor], list[str]]:
    """``n`` images of 1..``max_digits`` digits drawn from ``images`` side by side (1, 8, 8k),
    and their digit strings."""
    out, texts = [], []
    counts = torch.randint(1, max_digits + 1, (n,), generator=generator).tolist()
    for k in counts:
        rows = torch.randint(len(labels), (k,), generator=generator)
        out.append(torch.cat(list(images[rows]), dim=-1))  # (1, 8, 8k)
        texts.append("".join(str(int(d)) for d in labels[rows]))
    return out, texts


def pad_images(images: list[torch.Tensor], patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of one height and various widths -> (B, C, H, W_max) padded on the right with
    background, and the mask (B, N) of real patches (raster order, rows of W_max / P)."""
    H, W = images[0].shape[-2], max(im.shape[-1] for im in images)
    batch = torch.zeros(len(images), images[0].shape[0], H, W)
    cols = torch.zeros(len(images), dtype=torch.long)
    for b, im in enumerate(images):
        batch[b, :, :, : im.shape[-1]] = im
        cols[b] = im.shape[-1] // patch_size
    grid_cols = torch.arange(W // patch_size)
    mask = (grid_cols[None, :] < cols[:, None])[:, None, :].expand(-1, H // patch_size, -1)  # (B, rows, cols)
    return batch, mask.reshape(len(images), -1)


# ---------------------------------------------------------------------- PNG files
def read_png(path: str | Path, height: int, width: int) -> torch.Tensor:
    """A PNG (or any image Pillow reads) as a (1, height, width) grey image in [0, 1], ink
    bright: scaled with area averaging, and inverted when its border is lighter than its
    middle (dark ink on white paper, unlike the digits' white ink on black)."""
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415 - Pillow comes with matplotlib

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: image file not found")
    try:
        with Image.open(path) as im:
            grey = im.convert("L").resize((width, height), Image.Resampling.BOX)
    except (UnidentifiedImageError, OSError) as e:
        raise UsageError(f"{path}: not an image Pillow can read ({e})") from None
    x = torch.from_numpy(np.asarray(grey, dtype=np.float32) / 255.0)
    border = torch.cat([x[0], x[-1], x[:, 0], x[:, -1]]).mean()
    middle = x[1:-1, 1:-1].mean() if min(height, width) > 2 else x.mean()
    if border > middle:
        x = 1.0 - x
    return x[None]


def write_png(image: torch.Tensor, path: str | Path, scale: int = 8) -> Path:
    """A (1, H, W) image in [0, 1] as a PNG, ``scale`` times larger, dark ink on white (as a
    scan would be; ``read_png`` turns it back)."""
    from PIL import Image  # noqa: PLC0415

    pixels = ((1.0 - image[0].clamp(0, 1)) * 255).round().to(torch.uint8).numpy()
    im = Image.fromarray(pixels)  # uint8 (H, W): mode "L"
    im = im.resize((im.width * scale, im.height * scale), Image.Resampling.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m blockformer.data.images DIR [--split test] [--n 10]``: write digits as PNGs."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m blockformer.data.images",
                                     description="Write held-out digits as PNG files (name: index_label.png).")
    parser.add_argument("dir")
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--n", type=int, default=10)
    args = parser.parse_args(argv)
    images, labels = load_digits_split(args.split)
    for i in range(min(args.n, len(labels))):
        print(write_png(images[i], Path(args.dir) / f"{i:03d}_{int(labels[i])}.png"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
