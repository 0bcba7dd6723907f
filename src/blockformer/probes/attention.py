"""Where each head looks: attention weights per layer and head, with their entropy.

``scaled_dot_product_attention`` does not return its weights (the fused kernel never forms
them), so a forward hook on each attention module recomputes them from the module's own
projections and the inputs it was given: ``softmax(q k^T / sqrt(d) + mask/bias)``, with rope
applied as the module applies it. The hook also rebuilds the module's output from those
weights (``out(weights @ v)``) and reports the largest difference from the real output, so
the figure shows what the model computed, not an approximation of it. The model code is
unchanged.

Entropy (bits) per head: the mean over query positions of ``-sum_j w_j log2 w_j``; the
"uniform" figure is the same for weights spread evenly over the visible keys. A random
model attends almost uniformly; trained heads focus (low entropy) on a few positions.

For a checkpoint that reads image patches (``model.input = "patches"``), the probe shows
what the class token reads: its attention row over the patches of one image (``--image N``
of the held-out split, or ``--png FILE``), drawn as a map over the patch grid per layer and
head, and the share of that attention that falls on patches with ink, against the share of
such patches (uniform reading).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import TransformerConfig
from ..errors import UsageError
from ..models import build_model
from ..nn.attention import Attention, AttnInputs
from ..nn.position import apply_rope
from .report import ProbeResult, plot_label
from ..data.images import load_digits_split, pad_images, read_png
from ..train.load import load_checkpoint
from ..models.inputs import patchify
from ..data.images import DIGIT_SIZE
from ..tokenizers import BOS_ID
from ..train.arrays import decode_images
from ..run_config import load_run_config
from ..train.load import read_config
from ..data.arrays import DigitStrings


def recompute(module: Attention, x: torch.Tensor, ctx: AttnInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (B, H, Tq, Tk), output (B, Tq, d_model)) of ``module`` on ``x`` and ``ctx``,
    computed explicitly in float32."""
    B, T, _ = x.shape
    H, H_kv, hd = module.n_heads, module.n_kv_heads, module.head_dim

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(B, t.shape[1], n, hd).transpose(1, 2)  # (B, n, T, head_dim)

    if module.cross:
        if ctx.memory is None:
            raise UsageError("attention probe: cross-attention keys from a cache are not supported; "
                             "run without a cache")
        q = heads(module.q(x), H)
        k, v = (heads(t, H_kv) for t in module.kv(ctx.memory).chunk(2, dim=-1))
    else:
        if ctx.cache is not None:
            raise UsageError("attention probe: run the model without a KV cache")
        q, k, v = module.qkv(x).split([H * hd, H_kv * hd, H_kv * hd], dim=-1)
        q, k, v = heads(q, H), heads(k, H_kv), heads(v, H_kv)
        if ctx.rope is not None:
            q, k = (apply_rope(t, *ctx.rope, module.rope_interleaved) for t in (q, k))
    k, v = k.repeat_interleave(H // H_kv, dim=1), v.repeat_interleave(H // H_kv, dim=1)  # GQA
    scale = 1 / math.sqrt(hd) if module.scale is None else module.scale  # T5: no scaling (1.0)
    scores = q.float() @ k.float().transpose(-2, -1) * scale  # (B, H, Tq, Tk)
    if ctx.mask is not None:
        mask = ctx.mask
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:  # a float mask: position bias (alibi, relative) with -inf where hidden
            scores = scores + mask.float()
    elif ctx.is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    weights = scores.softmax(dim=-1)
    y = (weights @ v.float()).transpose(1, 2).reshape(B, T, H * hd)
    return weights, module.out(y.to(x.dtype))


def capture(model: nn.Module, call: Any) -> list[dict[str, Any]]:
    """Run ``call()`` with a hook on every attention module of ``model``; per module (in call
    order): its name, weights (H, Tq, Tk) of batch row 0, and the output reproduction error."""
    records: list[dict[str, Any]] = []

    def hook(name: str):
        def fn(module: Attention, args: tuple, output: torch.Tensor) -> None:
            x, ctx = args
            weights, rebuilt = recompute(module, x, ctx)
            records.append({"module": name, "cross": module.cross, "weights": weights[0].detach().cpu(),
                            "error": (rebuilt.float() - output.float()).abs().max().item()})

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, Attention)]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    return records


def entropy_bits(weights: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per head: mean entropy (bits) over query rows, and the same for uniform weights over
    each row's visible keys."""
    w = weights.double()
    h = -(w * torch.where(w > 0, w.log2(), torch.zeros_like(w))).sum(-1)  # (H, Tq)
    visible = (w > 0).sum(-1).clamp(min=1).double()  # keys a row can see
    return h.mean(-1).tolist(), visible.log2().mean(-1).tolist()


def mean_distance(weights: torch.Tensor) -> list[float]:
    """Per head: the expected |query position - key position| (self-attention only)."""
    Tq, Tk = weights.shape[-2:]
    dist = (torch.arange(Tq)[:, None] - torch.arange(Tk)[None, :]).abs().double()
    return (weights.double() * dist).sum(-1).mean(-1).tolist()


def _model_and_tokens(
    checkpoint: str | None, preset: str | None, cfg: TransformerConfig, seed: int, text: str, target: str
) -> tuple[nn.Module, Any, list[int], list[int]]:
    """(model, decode-one-token function, source/input ids, target ids)."""
    if checkpoint:

        ckpt = load_checkpoint(checkpoint)
        model, tok = ckpt.model, ckpt.tokenizer
        ids, tgt = tok.encode(text), [1] + tok.encode(target)  # tgt_in starts with bos
        return model, lambda i: tok.decode([i]) if i > 3 else "<bos>" if i == 1 else f"<{i}>", ids, tgt
    if preset:

        cfg = load_run_config(preset=preset).model
    model = build_model(cfg, seed=seed).eval()
    # No tokenizer: number the characters in order of appearance (the model is random,
    # ids need only be distinct), wrapping if the vocabulary is smaller.
    chars = list(dict.fromkeys(text + target))
    to_id = {ch: 4 + i % (cfg.vocab_size - 4) for i, ch in enumerate(chars)}
    names = {v: k for k, v in to_id.items()} | {1: "<bos>"}
    return model, lambda i: names.get(i, f"<{i}>"), [to_id[c] for c in text], [1] + [to_id[c] for c in target]


def run(
    text: str = "小明打小红",
    checkpoint: str | None = None,
    preset: str | None = None,
    target: str = "",
    arch: str = "decoder",
    n_layers: int = 2,
    n_heads: int = 4,
    d_model: int = 64,
    position: str = "rope",
    seed: int = 0,
    image: int = 0,
    png: str = "",
) -> ProbeResult:
    """Attention weights of every layer and head for ``text`` (for an encoder-decoder, the
    source; ``target`` is the decoder's input after bos). Without ``checkpoint``, a random
    model from ``preset`` or the given sizes."""
    if checkpoint:

        if read_config(checkpoint).model.input == "patches":
            return patch_run(checkpoint, image, png)
    if not text:
        raise UsageError("--text: expected a non-empty text")
    cfg = TransformerConfig(arch=arch, d_model=d_model, n_layers=n_layers, n_heads=n_heads, position=position,
                            vocab_size=260, max_seq_len=256)
    model, name_of, ids, tgt = _model_and_tokens(checkpoint, preset, cfg, seed, text, target)
    cfg = model.cfg
    ids, tgt = ids[: cfg.max_seq_len], tgt[: cfg.max_seq_len]
    if not ids:
        raise UsageError(f"--text {text!r}: encodes to no tokens")
    src = torch.tensor([ids], device=next(model.parameters()).device)
    if cfg.arch == "encoder-decoder":
        tgt_t = torch.tensor([tgt], device=src.device)
        records = capture(model, lambda: model(src, tgt_t))
    else:
        records = capture(model, lambda: model(src))
    src_tokens, tgt_tokens = [name_of(i) for i in ids], [name_of(i) for i in tgt]
    rows, layers = [], []
    for r in records:
        is_decoder_side = cfg.arch == "encoder-decoder" and r["module"].startswith("decoder")
        queries = tgt_tokens if is_decoder_side else src_tokens
        keys = src_tokens if (r["cross"] or not is_decoder_side) else tgt_tokens
        ent, uniform = entropy_bits(r["weights"])
        dist = mean_distance(r["weights"]) if not r["cross"] else [None] * len(ent)
        layers.append({"module": r["module"], "cross": r["cross"], "queries": queries, "keys": keys,
                       "weights": r["weights"].tolist(), "entropy_bits": ent, "uniform_bits": uniform,
                       "mean_distance": dist, "reproduction_error": r["error"]})
        for h, (e, u, d) in enumerate(zip(ent, uniform, dist)):
            rows.append([r["module"], h, e, u, e / u if u > 0 else 1.0, d, r["error"]])
    if checkpoint:
        source = f"checkpoint {checkpoint}"
    else:
        source = f"random model ({preset or 'given sizes'}, seed {seed})"
    return ProbeResult(
        name="attention",
        claim="each head's attention weights and entropy: where each position gathers from",
        columns=["module", "head", "entropy bits", "uniform bits", "entropy / uniform", "mean distance",
                 "reproduction error"],
        rows=rows,
        data={"source": source, "text": text, "tokens": src_tokens, "target_tokens": tgt_tokens,
              "layers": layers, "arch": cfg.arch},
        notes=[
            f"{source}; {len(ids)} tokens.",
            "entropy / uniform near 1: the head spreads evenly over what it may see; near 0: it "
            "attends to one position. mean distance: how far back (or away) the head looks, in positions.",
            "reproduction error: |out(weights @ v) - the module's real output|; small means the weights "
            "shown are the ones the model used.",
        ],
        plotter=plot,
    )


def plot(result: ProbeResult, fig: Any) -> None:
    """A heat map per layer (rows) and head (columns), queries down, keys across."""
    layers = result.data["layers"]
    n_heads = len(layers[0]["weights"])
    fig.set_size_inches(min(3.0 * n_heads + 1, 24), min(2.8 * len(layers) + 1, 40))
    axes = fig.subplots(len(layers), n_heads, squeeze=False)
    for row, layer in zip(axes, layers):
        queries = [plot_label(t) for t in layer["queries"]]
        keys = [plot_label(t) for t in layer["keys"]]
        for h, ax in enumerate(row):
            ax.imshow(layer["weights"][h], vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_title(f"{layer['module']} h{h}\nH={layer['entropy_bits'][h]:.2f} bits", fontsize=7)
            for axis, labels, setter in ((ax.xaxis, keys, ax.set_xticks), (ax.yaxis, queries, ax.set_yticks)):
                if len(labels) <= 24:
                    setter(range(len(labels)), labels, fontsize=6, rotation=90 if axis is ax.xaxis else 0)
                else:
                    setter([])


# ---------------------------------------------------------------------- image patches
INK = 0.25  # a patch "has ink" when its mean pixel (in [0, 1]) is above this


def class_token_reads(weights: torch.Tensor, has_cls: bool, n_patches: int) -> torch.Tensor:
    """(H, T, T) self-attention weights -> (H, n_patches): the class token's row over the
    patches, or without a class token the mean attention each patch receives."""
    if has_cls:
        return weights[:, 0, 1 : 1 + n_patches]
    return weights[:, :, :n_patches].mean(dim=1)


def patch_run(checkpoint: str, image: int = 0, png: str = "") -> ProbeResult:
    """What the class token of a patch-reading checkpoint attends to, for one image."""

    ckpt = load_checkpoint(checkpoint)
    cfg, model = ckpt.config.model, ckpt.model
    if png:
        x, truth, source = read_png(png, cfg.image_height, cfg.image_width), None, png
    elif cfg.arch == "encoder-decoder":  # the held-out digit strings it was trained to read

        images, texts = DigitStrings("test", ckpt.config, ckpt.tokenizer, 1, train=False).heldout(image + 1)
        x, truth, source = images[image], texts[image], f"test string {image}"
    else:
        images, labels = load_digits_split("test")
        if not 0 <= image < len(labels):
            raise UsageError(f"--image {image}: expected an index into the {len(labels)} held-out test images")
        x, truth, source = images[image], str(int(labels[image])), f"test image {image}"
    batch, mask = pad_images([x], cfg.patch_size)
    call = (lambda: model.encode(batch, mask)) if cfg.arch == "encoder-decoder" else \
        (lambda: model(batch, attention_mask=mask))
    predicted = None
    if ckpt.config.head.task == "classify":
        with torch.no_grad():
            predicted = ckpt.config.head.labels[int(model(batch, attention_mask=mask).argmax())]
    cross_rows, cross = [], []
    if cfg.arch == "encoder-decoder":
        predicted, cross_rows, cross = _cross_reads(ckpt, batch, mask, x.shape[-1] // cfg.patch_size, truth)
    records = [r for r in capture(model, call) if not r["cross"]]
    rows_, cols_ = x.shape[-2] // cfg.patch_size, x.shape[-1] // cfg.patch_size
    n = rows_ * cols_

    ink = patchify(x[None], cfg.patch_size)[0].mean(-1) > INK  # (N,)
    ink_share = float(ink.float().mean())
    rows, layers = [], []
    for r in records:
        reads = class_token_reads(r["weights"], cfg.cls_token, n)  # (H, N)
        ent, uniform = entropy_bits(r["weights"][:, :1] if cfg.cls_token else r["weights"])
        on_ink = (reads[:, ink].sum(-1) / reads.sum(-1).clamp(min=1e-12)).tolist()
        layers.append({"module": r["module"], "grid": reads.reshape(-1, rows_, cols_).tolist(),
                       "entropy_bits": ent, "uniform_bits": uniform, "on_ink": on_ink,
                       "reproduction_error": r["error"]})
        for h, (e, u, o) in enumerate(zip(ent, uniform, on_ink)):
            rows.append([r["module"], h, e, u, o, ink_share, r["error"]])
    reader = "the class token" if cfg.cls_token else "the patches (no class token: the mean over queries)"
    return ProbeResult(
        name="attention",
        claim=f"which patches {reader} reads, per layer and head",
        columns=["module", "head", "entropy bits", "uniform bits", "attention on ink", "ink patches",
                 "reproduction error"],
        rows=rows,
        data={"source": f"checkpoint {checkpoint}", "image": x[0].tolist(), "label": truth, "predicted": predicted,
              "patch_size": cfg.patch_size, "cls_token": cfg.cls_token, "layers": layers, "ink_share": ink_share,
              "cross": cross},
        more_tables=[("cross-attention: what the decoder reads as it writes each character of the "
                       + ("true string" if truth is not None else "greedy output") + " (mean over heads)",
                      ["module", "position", "writes", "on its digit's patches", "uniform"], cross_rows)]
        if cross_rows else [],
        notes=[
            f"checkpoint {checkpoint}; {source}" + (f" (label {truth})" if truth is not None else "")
            + (f", predicted {predicted}" if predicted is not None else "") + f"; {n} patches.",
            f"attention on ink: the share of the attention of {reader} on patches whose mean pixel is above "
            f"{INK}; ink patches: their share of all patches (what uniform attention would give).",
            "entropy (bits): of the class token's row, or of every query's row without one; uniform: "
            "the same for even weights over all positions.",
        ],
        plotter=plot_patches,
    )


def _cross_reads(ckpt: Any, batch: torch.Tensor, mask: torch.Tensor, cols: int,
                 truth: str | None) -> tuple[str, list, list]:
    """An image-to-text model's greedy text for ``batch`` (one image), and per decoder layer
    the cross-attention (mean over heads) of each character over the patch grid as the
    decoder writes it (the true string, teacher-forced, when it is known; else the greedy
    text), with the share on the patches of its own digit (digits are 8 pixels wide)."""

    cfg, model = ckpt.config.model, ckpt.model
    predicted = decode_images(model, ckpt.tokenizer, [batch[0]], cfg.patch_size)[0]
    text = truth if truth is not None else predicted
    tgt = torch.tensor([[BOS_ID] + ckpt.tokenizer.encode(text)])
    records = [r for r in capture(model, lambda: model(batch, tgt, src_mask=mask)) if r["cross"]]
    slot = DIGIT_SIZE // cfg.patch_size  # patch columns per digit
    rows, layers = [], []
    for r in records:
        w = r["weights"].mean(0)  # (T, N): queries are bos + the text; query k writes character k
        grid = w.reshape(w.shape[0], -1, cols)
        layers.append({"module": r["module"], "text": text, "grid": grid[: len(text)].tolist()})
        for k, ch in enumerate(text):
            own = float(grid[k, :, k * slot : (k + 1) * slot].sum()) if (k + 1) * slot <= cols else float("nan")
            rows.append([r["module"], k, ch, own, slot / cols])
    return predicted, rows, layers


def plot_patches(result: ProbeResult, fig: Any) -> None:
    """The image, then one map over the patch grid per layer (rows) and head (columns)."""
    layers, cross = result.data["layers"], result.data.get("cross") or []
    n_heads = len(layers[0]["grid"])
    width = max([n_heads] + [len(c["grid"]) for c in cross])
    fig.set_size_inches(2.2 * (width + 1) + 1, 2.2 * (len(layers) + len(cross)) + 0.6)
    axes = fig.subplots(len(layers) + len(cross), width + 1, squeeze=False)
    for row, layer in zip(axes[len(layers) :], cross):  # what each written character reads
        row[0].imshow(result.data["image"], cmap="gray", vmin=0, vmax=1)
        row[0].set_title(f"writes {layer['text']!r}", fontsize=7)
        for k, ax in enumerate(row[1:]):
            if k < len(layer["grid"]):
                ax.imshow(layer["grid"][k], cmap="viridis", vmin=0.0)
                ax.set_title(f"{layer['module']}\nwriting {layer['text'][k]!r}", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
        row[0].set_xticks([])
        row[0].set_yticks([])
    axes = axes[: len(layers)]
    for i, (row, layer) in enumerate(zip(axes, layers)):
        row[0].imshow(result.data["image"], cmap="gray", vmin=0, vmax=1)
        row[0].set_title("image" + (f" ({result.data['label']})" if result.data["label"] is not None else ""),
                         fontsize=7)
        for h, ax in enumerate(row[1 : n_heads + 1]):
            grid = layer["grid"][h]
            ax.imshow(grid, cmap="viridis", vmin=0.0)
            ax.set_title(f"{layer['module']} h{h}\non ink {layer['on_ink'][h]:.0%}", fontsize=7)
        for ax in row:
            ax.set_xticks([])
            ax.set_yticks([])
