"""Input adapters: shapes and masks; patches are permutation-equivariant without positions and
not with 2-D positions; padding never changes real frames or patches; a patch-to-text
encoder-decoder decodes through the KV cache exactly as through the full forward."""

import dataclasses

import pytest
import torch

from blockformer.config import TransformerConfig
from blockformer.errors import UsageError
from blockformer.generate import beam_search, greedy_decode
from blockformer.models import build_model
from blockformer.models.heads import SequenceHead, TaskModel
from blockformer.models.inputs import FrameInput, PatchInput, patchify
from blockformer.nn.position import sinusoidal_table
from blockformer.nn.position2d import Position2d
from blockformer.data.images import pad_images


def patches_cfg(**kw) -> TransformerConfig:
    base = dict(arch="encoder", input="patches", d_model=32, n_heads=4, n_layers=2, patch_size=2,
                image_height=8, image_width=8, position="none", max_seq_len=64)
    return TransformerConfig(**{**base, **kw})


def frames_cfg(**kw) -> TransformerConfig:
    base = dict(arch="encoder", input="frames", frame_dim=5, d_model=32, n_heads=4, n_layers=2, max_seq_len=40)
    return TransformerConfig(**{**base, **kw})


# ---------------------------------------------------------------------- shapes and masks
def test_patchify_takes_p_by_p_blocks_row_by_row():
    img = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(1, 2, 4, 6)  # C=2, H=4, W=6
    p = patchify(img, 2)  # 2 rows x 3 cols of patches, 2*2*2 values each
    assert p.shape == (1, 6, 8)
    r, c = 1, 2  # patch 5
    assert torch.equal(p[0, 5], img[0, :, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].reshape(-1))


@pytest.mark.parametrize("cls_token", [False, True])
def test_patch_adapter_shapes_positions_and_masks(cls_token):
    cfg = patches_cfg(cls_token=cls_token, image_width=16)
    adapter = PatchInput(cfg)
    images = torch.rand(3, 1, 8, 12)  # narrower than image_width: allowed
    x, positions, mask = adapter(images)  # (8 / 2) x (12 / 2) = 24 patches
    assert x.shape == (3, 24 + cls_token, 32) and positions.shape == (3, 24 + cls_token) and mask is None
    m = torch.ones(3, 24, dtype=torch.bool)
    m[1, -6:] = False
    _, _, out_mask = adapter(images, m)
    assert out_mask.shape == (3, 24 + cls_token)
    assert torch.equal(out_mask[:, cls_token:], m) and (not cls_token or bool(out_mask[:, 0].all()))


def test_frame_adapter_shapes_and_masks():
    adapter = FrameInput(frames_cfg(cls_token=True, position="learned"))
    frames = torch.randn(2, 7, 5)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    x, positions, out_mask = adapter(frames, mask)
    assert x.shape == (2, 8, 32)
    assert positions[0].tolist() == list(range(8))
    assert out_mask[1].tolist() == [True] * 5 + [False] * 3


@pytest.mark.parametrize("bad, match", [
    (lambda a: a(torch.rand(2, 3, 8, 8)), "expected \\(batch, 1, height, width\\)"),
    (lambda a: a(torch.rand(2, 1, 8, 7)), "multiples of patch_size=2"),
    (lambda a: a(torch.rand(2, 1, 8, 10)), "at most image_height=8 x image_width=8"),
    (lambda a: a(torch.rand(2, 1, 8, 8), torch.ones(2, 15, dtype=torch.bool)), "expected \\(2, 16\\)"),
])
def test_patch_adapter_names_what_is_wrong(bad, match):
    with pytest.raises(UsageError, match=match):
        bad(PatchInput(patches_cfg()))


def test_frame_adapter_rejects_the_wrong_width_and_length():
    adapter = FrameInput(frames_cfg())
    with pytest.raises(UsageError, match="frame_dim=5"):
        adapter(torch.randn(1, 4, 6))
    with pytest.raises(UsageError, match="at most 40"):
        adapter(torch.randn(1, 41, 5))


@pytest.mark.parametrize("kw, match", [
    (dict(arch="decoder"), "arch="),
    (dict(image_width=9), "image_width=9: expected a multiple of patch_size=2"),
    (dict(d_model=30, n_heads=3), "d_model=30: expected a multiple of 4"),
    (dict(max_seq_len=10), "max_seq_len=10: expected >= the 16 patches"),
])
def test_config_validates_the_input_group(kw, match):
    with pytest.raises(ValueError, match=match):
        patches_cfg(**kw)
    with pytest.raises(ValueError, match="cls_token=True: expected False with input='tokens'"):
        TransformerConfig(cls_token=True)


def test_2d_positions_are_a_row_half_and_a_column_half():
    pos = Position2d("sinusoidal", 16, 4, 5)
    v = pos(torch.tensor([2]), torch.tensor([3]))[0]
    assert torch.equal(v[:8], sinusoidal_table(4, 8)[2]) and torch.equal(v[8:], sinusoidal_table(5, 8)[3])
    learned = Position2d("learned", 16, 4, 5)
    same_row = learned(torch.tensor([1, 1]), torch.tensor([0, 4]))
    assert torch.equal(same_row[0, :8], same_row[1, :8]) and not torch.equal(same_row[0, 8:], same_row[1, 8:])


# ---------------------------------------------------------------------- equivariance
def _permute_patches(images: torch.Tensor, perm: torch.Tensor, P: int) -> torch.Tensor:
    """The image whose patch i is patch perm[i] of ``images``."""
    B, C, H, W = images.shape
    cols = W // P
    out = torch.empty_like(images)
    for i, j in enumerate(perm.tolist()):
        ri, ci, rj, cj = i // cols, i % cols, j // cols, j % cols
        out[:, :, ri * P : ri * P + P, ci * P : ci * P + P] = images[:, :, rj * P : rj * P + P, cj * P : cj * P + P]
    return out


@pytest.mark.parametrize("patch_position, position", [("none", "rope"), ("none", "sinusoidal"),
                                                      ("learned", "none"), ("sinusoidal", "none")])
def test_permuting_patches_permutes_outputs_only_without_2d_positions(patch_position, position):
    torch.manual_seed(0)
    model = build_model(patches_cfg(patch_position=patch_position, position=position), seed=0).eval()
    if patch_position == "learned":  # trained tables are not near zero: make the signal visible
        torch.nn.init.normal_(model.embed.position.rows.weight, 0, 1.0)
        torch.nn.init.normal_(model.embed.position.cols.weight, 0, 1.0)
    images = torch.rand(2, 1, 8, 8)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.hidden_states(images)
        out_perm = model.hidden_states(_permute_patches(images, perm, 2))
    diff = (out_perm - out[:, perm]).abs().max().item()
    if patch_position == "none":  # position (rope / sinusoidal) is the 1-D scheme: unused by the patch stack
        assert diff < 1e-5
    else:
        assert diff > 1e-2


# ---------------------------------------------------------------------- padding
@pytest.mark.parametrize("position, cls_token", [("rope", False), ("learned", True), ("sinusoidal", False),
                                                 ("alibi", True), ("relative", False)])
def test_padded_frames_never_change_the_real_frames(position, cls_token):
    model = build_model(frames_cfg(position=position, cls_token=cls_token), seed=0).eval()
    task = TaskModel(model, SequenceHead(32, 3, "mean")).eval()
    real = torch.randn(1, 6, 5)
    padded = torch.cat([real, 100 * torch.randn(1, 9, 5)], dim=1)  # garbage in the padding
    mask = torch.tensor([[True] * 6 + [False] * 9])
    with torch.no_grad():
        a = model.hidden_states(real)
        b = model.hidden_states(padded, attention_mask=mask)
        pa, pb = task(real), task(padded, attention_mask=mask)
    n = 6 + cls_token
    torch.testing.assert_close(b[:, :n], a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pb, pa, atol=1e-5, rtol=1e-5)


def test_padding_a_narrow_image_never_changes_its_real_patches():
    model = build_model(patches_cfg(image_width=16, cls_token=True, patch_position="learned"), seed=0).eval()
    narrow = torch.rand(1, 8, 6)
    batch, mask = pad_images([narrow, torch.rand(1, 8, 16)], 2)
    assert batch.shape == (2, 1, 8, 16) and mask.shape == (2, 32) and int(mask[0].sum()) == 12
    with torch.no_grad():
        alone = model.hidden_states(narrow[None])  # (1, 1 + 12, d)
        together = model.hidden_states(batch, attention_mask=mask)
    real = model.hidden_mask(mask)[0]
    torch.testing.assert_close(together[0, real], alone[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- patches -> text
def _image_to_text(cls_token: bool):
    cfg = TransformerConfig(arch="encoder-decoder", input="patches", image_width=24, patch_size=2, vocab_size=14,
                            d_model=32, n_heads=4, n_layers=2, position="rope", cls_token=cls_token,
                            max_seq_len=64, tie_embeddings=False)
    model = build_model(cfg, seed=3).eval()
    images, mask = pad_images([torch.rand(1, 8, 24), torch.rand(1, 8, 8), torch.rand(1, 8, 16)], 2)
    return model, images, mask


@pytest.mark.parametrize("cls_token", [False, True])
def test_patch_to_text_decodes_through_the_cache_as_the_full_forward(cls_token):
    model, images, mask = _image_to_text(cls_token)
    cached = greedy_decode(model, images, mask, max_len=8)
    full = greedy_decode(model, images, mask, max_len=8, use_cache=False)
    assert cached == full
    # Teacher-forced logits: step by step through the cache equal one full forward pass.
    tgt = torch.tensor([[1] + [4 + i % 10 for i in range(6)]] * 3)
    with torch.no_grad():
        reference = model(images, tgt, src_mask=mask)
        cache = model.new_cache(3, tgt.shape[1])
        memory, memory_mask = model.encode(images, mask), model.hidden_mask(mask)
        steps = [model.decode(tgt[:, :1], memory, memory_mask, cache=cache, cache_pos=torch.tensor([0]))]
        for t in range(1, tgt.shape[1]):
            steps.append(model.decode(tgt[:, t : t + 1], None, cache=cache, cache_pos=torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), reference, atol=1e-5, rtol=1e-5)
    assert (reference[0] - reference[1]).abs().max() > 1e-3  # cross-attention: the image changes the text
    beams = beam_search(model, images, mask, beam_size=3, max_len=8)
    beams_full = beam_search(model, images, mask, beam_size=3, max_len=8, use_cache=False)
    assert [b[0].tokens for b in beams] == [b[0].tokens for b in beams_full]


def test_source_of_floats_is_required_for_a_patch_encoder():
    model, _, _ = _image_to_text(False)
    with pytest.raises(UsageError, match="float tensor of patches"):
        greedy_decode(model, [[4, 5, 6]], max_len=3)


def test_a_stack_reading_patches_has_no_1d_position_signal():
    model = build_model(patches_cfg(position="rope"), seed=0)
    assert model.encoder.rotary is None and model.cfg.position == "rope"
    cfg = dataclasses.replace(patches_cfg(), arch="encoder-decoder", position="alibi", vocab_size=20)
    ed = build_model(cfg, seed=0)
    assert ed.encoder.bias is None and ed.decoder.bias is not None


def test_info_names_the_three_swappable_parts(capsys):
    from blockformer.cli import main

    assert main(["info", "--preset", "digits-vit"]) == 0
    out = capsys.readouterr().out
    assert "input        patches: 2x2 pixels of 8x8x1 images -> 16 patches, Linear(4, 64) + a class token" in out
    assert "position     2-D learned" in out and "head         classify head (cls pooling)" in out
    assert main(["info", "--preset", "vowels-frames", "--set", "head.pooling=auto"]) == 0
    out = capsys.readouterr().out
    assert "frames: 12 values per time step" in out and "1-D rope" in out and "(mean pooling)" in out


def test_freezing_embeddings_freezes_the_input_adapter():
    from blockformer.run_config import load_run_config
    from blockformer.train.finetune import build_model_for

    cfg = load_run_config(preset="digits-vit", overrides=["train.freeze=embeddings", "head.labels=a,b"])
    model = build_model_for(cfg, seed=0, log=None)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith("body.embed.")} and len(frozen) == 5
