"""Images and signals as run data: the digits splits, shifts, strings of digits, PNG files;
short training runs of the three presets, `predict` on PNGs and held-out splits, the
class-token attention probe, and one-line errors for configs that do not fit the data."""

import json
import math

import pytest
import torch

from blockformer.cli import main
from blockformer.data.images import (
    affine,
    digit_strings,
    load_digits_split,
    pad_images,
    read_png,
    rotate_scale,
    shift,
    write_png,
)
from blockformer.errors import UsageError
from blockformer.probes import attention
from blockformer.run_config import load_run_config
from blockformer.train import train
from blockformer.data.arrays import DigitStrings, check_dataset

QUIET = dict(log=lambda *a: None)
FAST = ["train.progress=false", "train.samples=0"]


def test_digits_splits_are_fixed_disjoint_and_stratified():
    sizes = {}
    for split in ("train", "val", "test"):
        images, labels = load_digits_split(split)
        assert images.shape[1:] == (1, 8, 8) and float(images.min()) >= 0 and float(images.max()) <= 1
        sizes[split] = len(labels)
        assert labels.bincount(minlength=10).min() >= 0.9 * len(labels) / 10  # every digit, in proportion
    assert sizes == {"train": 1293, "val": 144, "test": 360}
    from blockformer.data.images import _digits

    rows = [set(r.tolist()) for r in _digits()[2].values()]
    assert sum(len(r) for r in rows) == 1797 and len(set.union(*rows)) == 1797  # disjoint, all used


def test_shift_moves_pixels_and_fills_with_background():
    img = torch.zeros(64, 1, 8, 8)
    img[:, 0, 3, 4] = 1.0
    moved = shift(img, 1, torch.Generator().manual_seed(0))
    rows, cols = (moved[:, 0] == 1).nonzero()[:, 1], (moved[:, 0] == 1).nonzero()[:, 2]
    assert moved.sum().item() == 64  # nothing lost (the pixel is inside the border)
    assert set(rows.tolist()) == {2, 3, 4} and set(cols.tolist()) == {3, 4, 5}
    assert torch.equal(shift(img, 0, torch.Generator()), img)


def _centroids(images: torch.Tensor) -> torch.Tensor:
    """(B, 2) ink-weighted (x, y) of each image, in pixels from the centre, y up."""
    H, W = images.shape[-2:]
    ys, xs = torch.meshgrid(torch.arange(H) - (H - 1) / 2, torch.arange(W) - (W - 1) / 2, indexing="ij")
    w = images[:, 0]
    mass = w.sum((1, 2))
    return torch.stack([(w * xs).sum((1, 2)) / mass, -(w * ys).sum((1, 2)) / mass], -1)


def test_rotate_scale_turns_a_quarter_as_rot90_and_scales_about_the_centre():
    img = torch.rand(3, 1, 8, 8)
    quarter = rotate_scale(img, torch.full((3,), math.pi / 2), torch.ones(3))
    torch.testing.assert_close(quarter, torch.rot90(img, 1, (2, 3)), atol=1e-5, rtol=0)  # counter-clockwise
    block = torch.zeros(1, 1, 8, 8)
    block[0, 0, 2:4, 4:6] = 1.0  # centred at (x, y) = (1, 1) from the image centre
    torch.testing.assert_close(_centroids(block), torch.tensor([[1.0, 1.0]]))
    larger = rotate_scale(block, torch.zeros(1), torch.full((1,), 1.5))
    torch.testing.assert_close(_centroids(larger), torch.tensor([[1.5, 1.5]]), atol=1e-4, rtol=0)
    assert larger.sum().item() == pytest.approx(4 * 1.5**2, abs=0.01)  # the ink's area grows by 1.5^2


def test_affine_draws_angles_and_scales_within_their_bounds():
    block = torch.zeros(512, 1, 8, 8)
    block[:, 0, 2:4, 4:6] = 1.0  # centroid at radius sqrt(2), angle 45 degrees
    assert affine(block, 0.0, 0.0, torch.Generator()) is block
    moved = affine(block, 10.0, 0.1, torch.Generator().manual_seed(0))
    c = _centroids(moved)
    angle = torch.rad2deg(torch.atan2(c[:, 1], c[:, 0])) - 45.0
    radius = c.norm(dim=1) / math.sqrt(2)
    assert angle.abs().max() <= 12.0 and angle.std() > 4.0  # uniform on [-10, 10] (std 5.8), + resampling error
    assert radius.min() >= 0.86 and radius.max() <= 1.14 and radius.std() > 0.04  # uniform on [0.9, 1.1] (std 0.058)
    rotated = affine(block, 10.0, 0.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(_centroids(rotated).norm(dim=1), torch.full((512,), math.sqrt(2)), atol=0.03, rtol=0)


def test_digit_strings_put_digits_side_by_side_with_their_text():
    images, labels = load_digits_split("val")
    out, texts = digit_strings(images, labels, 20, 3, torch.Generator().manual_seed(0))
    assert {len(t) for t in texts} == {1, 2, 3}
    for im, t in zip(out, texts):
        assert im.shape == (1, 8, 8 * len(t)) and t.isdigit()
    batch, mask = pad_images(out, 2)
    assert batch.shape[-1] == 24 and mask.shape == (20, 4 * 12)
    assert [int(m.sum()) for m in mask] == [4 * 4 * len(t) for t in texts]


def test_training_strings_are_shifted_digit_by_digit_within_their_slots():
    cfg = load_run_config(preset="digits-to-text", overrides=["data.shift=1", "data.rotate=0", "data.zoom=0"])
    strings = DigitStrings("train", cfg, None, 8, train=True)
    images, texts = strings.make(64, torch.Generator().manual_seed(0))
    plain, plain_texts = digit_strings(strings.images, strings.labels, 64, 4, torch.Generator().manual_seed(0))
    assert texts == plain_texts and [im.shape for im in images] == [im.shape for im in plain]
    independent = 0
    for im, orig in zip(images, plain):
        slots, before = (x.reshape(1, 8, -1, 8).permute(2, 0, 1, 3) for x in (im, orig))  # (k, 1, 8, 8)
        torch.testing.assert_close(slots.sum((1, 2, 3)), before.sum((1, 2, 3)))  # each digit's ink stays in its slot
        moves = (_centroids(slots) - _centroids(before)).round(decimals=4)
        assert moves.abs().max() <= 1 and torch.equal(moves, moves.round())  # whole pixels, at most 1
        independent += len({tuple(m.tolist()) for m in moves}) > 1
    assert independent > 20  # digits of one string move differently
    held = DigitStrings("train", cfg, None, 8, train=False).make(64, torch.Generator().manual_seed(0))[0]
    assert all(torch.equal(a, b) for a, b in zip(held, plain))  # held-out strings are never augmented


def test_png_round_trip_and_dark_ink_on_white(tmp_path):
    images, _ = load_digits_split("test")
    path = write_png(images[0], tmp_path / "d.png")  # dark ink on white, 64x64
    back = read_png(path, 8, 8)
    assert back.shape == (1, 8, 8)
    assert (back - images[0]).abs().max() < 1 / 255 + 1e-6  # inverted back to white ink on black
    with pytest.raises(UsageError, match="not an image"):
        (tmp_path / "x.png").write_text("no")
        read_png(tmp_path / "x.png", 8, 8)


@pytest.mark.parametrize("sets, match", [
    (["model.input=frames", "model.frame_dim=12"], "model.input='frames': data.dataset='digits' is read as patches"),
    (["model.image_width=16", "model.max_seq_len=40"], "model.image_width=16: data.dataset='digits' needs 8"),
    (["head.task=none"], "head.task='none'"),
    (["data.dataset=digitz"], "did you mean 'digits'"),
    (["data.rotate=50"], r"data.rotate=50.0: expected degrees in \[0, 45\]"),
    (["data.zoom=-0.1"], r"data.zoom=-0.1: expected a float in \[0, 1\)"),
])
def test_configs_that_do_not_fit_the_data_set_fail_in_one_line(sets, match):
    with pytest.raises(UsageError, match=match):
        check_dataset(load_run_config(preset="digits-vit", overrides=sets))


@pytest.mark.parametrize("name", ["shift=1", "rotate=5", "zoom=0.1"])
def test_image_augmentation_is_refused_where_there_are_no_images(name):
    """Signals (japanese-vowels) and text runs would silently ignore it."""
    with pytest.raises(UsageError, match=rf"data.{name.split('=')[0]}=.*data.dataset='japanese-vowels' is read as frames"):
        check_dataset(load_run_config(preset="vowels-frames", overrides=[f"data.{name}"]))
    with pytest.raises(UsageError, match=rf"data.{name.split('=')[0]}=.*expected 0 without one"):
        load_run_config(preset="char-lm-tiny", overrides=[f"data.{name}"])


def test_patches_without_a_data_set_are_refused(tmp_path):
    cfg = load_run_config(preset="digits-vit", overrides=["data.dataset=", "head.task=none", "data.shift=0",
                                                         "data.rotate=0", "data.zoom=0"])
    with pytest.raises(UsageError, match="model.input='patches': reads images or signals"):
        train(cfg, tmp_path / "r", **QUIET)


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vit") / "run"
    cfg = load_run_config(preset="digits-vit", overrides=FAST + [
        "train.steps=150", "train.eval_every=150", "model.n_layers=2", "train.warmup=20"])
    result = train(cfg, run_dir, **QUIET)
    return run_dir, result


@pytest.mark.slow
def test_a_short_vit_run_learns_and_predicts_pngs_and_the_test_split(vit_run, tmp_path, capsys):
    run_dir, result = vit_run
    assert result.val["accuracy"] > 0.3  # 10 classes: chance is 0.1 (150 steps)
    images, labels = load_digits_split("test")
    for i in range(4):
        write_png(images[i], tmp_path / "png" / f"{i}.png")
    assert main(["predict", "--checkpoint", str(run_dir), "--input", str(tmp_path / "png")]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["input"].endswith(f"{i}.png") for i, r in enumerate(records)] == [True] * 4
    assert all(abs(sum(r["probs"].values()) - 1) < 1e-4 for r in records)
    assert main(["predict", "--checkpoint", str(run_dir), "--split", "test", "--output", str(tmp_path / "t.jsonl")]) == 0
    err = capsys.readouterr().err
    test = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    right = sum(r["label"] == r["truth"] for r in test)
    assert len(test) == 360 and f"accuracy {right / 360:.4f} ({right}/360) on the test split" in err
    assert [r["truth"] for r in test] == [str(int(y)) for y in labels]


@pytest.mark.slow
def test_the_attention_probe_shows_what_the_class_token_reads(vit_run, tmp_path):
    run_dir, _ = vit_run
    result = attention.run(checkpoint=str(run_dir), image=3)
    assert len(result.rows) == 2 * 4  # layers x heads
    for layer in result.data["layers"]:
        grid = torch.tensor(layer["grid"])  # (heads, 4, 4): the class token's row over the patches
        assert grid.shape == (4, 4, 4)
        assert torch.all(grid.sum(dim=(1, 2)) <= 1 + 1e-5) and torch.all(grid.sum(dim=(1, 2)) > 0.3)
        assert layer["reproduction_error"] < 1e-5
    assert result.data["label"] == str(int(load_digits_split("test")[1][3]))
    path = result.save_plot(tmp_path / "att.png")
    assert path.stat().st_size > 1000


def test_digit_strings_train_and_decode_through_predict(tmp_path, capsys):
    cfg = load_run_config(preset="digits-to-text", overrides=FAST + [
        "train.steps=30", "train.eval_every=30", "train.eval_samples=20", "data.heldout=20", "data.max_digits=2",
        "model.image_width=16"])
    result = train(cfg, tmp_path / "r", **QUIET)
    assert 0.0 <= result.val["exact_match"] <= 1.0 and result.val["val_loss"] < 3.0  # 14 ids: log 14 = 2.64
    assert main(["predict", "--checkpoint", str(tmp_path / "r"), "--split", "val", "--beam", "2"]) == 0
    out = capsys.readouterr()
    records = [json.loads(line) for line in out.out.splitlines()]
    assert len(records) == 20 and all(set(r["text"]) <= set("0123456789") for r in records)
    assert "exact match" in out.err
    probe = attention.run(checkpoint=str(tmp_path / "r"), image=0)  # cross-attention of each written character
    (_, columns, rows), = probe.more_tables
    assert rows and all(0.0 <= r[3] <= 1.0 or r[3] != r[3] for r in rows)  # a share, or nan past the last digit
    grid = torch.tensor(probe.data["cross"][0]["grid"])  # (characters, 4, columns): each row sums to 1
    torch.testing.assert_close(grid.sum(dim=(1, 2)), torch.ones(len(grid)), atol=1e-4, rtol=0)


def test_japanese_vowels_frames_train_with_a_mean_pooled_head(tmp_path):
    pytest.importorskip("sktime")
    from blockformer.data.frames import load_vowels_split

    series, labels = load_vowels_split("test")
    assert len(series) == 370 and {s.shape[1] for s in series} == {12} and labels.max() == 8
    cfg = load_run_config(preset="vowels-frames", overrides=FAST + ["train.steps=60", "train.eval_every=60"])
    result = train(cfg, tmp_path / "r", **QUIET)
    assert result.val["accuracy"] > 0.3  # 9 speakers: chance is 0.11
