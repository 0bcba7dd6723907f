"""Sequence parallelism and loss parallel under TP: the norms really see sequence shards, the
training loss really reads vocabulary shards, and the gradients equal the full model's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from blockformer.config import TransformerConfig
from blockformer.models import build_model
from blockformer.nn.loss import token_loss

from parallel_helpers import read_json, run_ranks, write_json

CONFIGS = {
    "decoder": dict(arch="decoder", norm="rms"),
    "encoder-decoder": dict(arch="encoder-decoder"),  # cross-attention reads the whole encoder memory
    "post-gated-moe": dict(arch="decoder", norm_position="post", residual="gated", ffn_experts=2,
                           experts_top_k=1, shared_experts=1, d_ff=64),
}


def _cfg(name: str) -> TransformerConfig:
    return TransformerConfig(vocab_size=30, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn="swiglu",
                             max_seq_len=16, bias=False, **CONFIGS[name])


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lengths 7 and 5: neither a multiple of tp = 2, so the sequence shards are uneven."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(1, 30, (2, 7), generator=g)
    src[1, 5:] = 0
    tgt = torch.randint(1, 30, (2, 5), generator=g)
    targets = torch.randint(1, 30, (2, 5), generator=g)
    targets[0, 3:] = 0  # padding: loss parallel's ignore_index
    return src, tgt, targets


def _loss(model: nn.Module, name: str, label_smoothing: float = 0.0) -> torch.Tensor:
    src, tgt, targets = _batch()
    if _cfg(name).arch == "decoder":
        return token_loss(model(tgt), targets, label_smoothing)
    return token_loss(model(src, tgt, src_mask=src > 0), targets, label_smoothing)


def _norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every norm between sublayers, and each stack's final norm."""
    return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in
            ("attn_norm", "cross_norm", "ffn_norm", "final_norm")]


def _placements(x) -> list[str]:
    """A DTensor's placements as ``Shard(d)`` (``d`` >= 0), ``Replicate``, ``Partial``; none for a tensor."""
    return [f"Shard({p.dim % x.ndim})" if p.is_shard() else type(p).__name__ for p in getattr(x, "placements", ())]


def _on_rank(rank: int, tmp: str) -> None:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from blockformer.parallel.loss import loss_context  # noqa: PLC0415
    from blockformer.parallel.mesh import Degrees, init_mesh  # noqa: PLC0415
    from blockformer.parallel.runtime import Parallel  # noqa: PLC0415
    from blockformer.parallel.tensor import apply_tp  # noqa: PLC0415

    degrees = Degrees(1, 1, 1, 2)
    mesh = init_mesh(degrees, torch.device("cpu"))
    par = Parallel(degrees=degrees, mesh=mesh, device=torch.device("cpu"), owns_group=False)
    out = {}
    for name in CONFIGS:
        model = build_model(_cfg(name), seed=0)
        rows = apply_tp(model, mesh["tp"], 2)
        seen: dict[str, list] = {}

        def record(key):
            def hook(module, args, output):
                x = args[0]
                seen.setdefault(key, []).append(
                    [type(x).__name__, _placements(x), list(x.shape),
                     list(x.to_local().shape) if isinstance(x, DTensor) else None,
                     [type(output).__name__, list(output.shape)]])
            return hook

        for key, norm in _norms(model):
            norm.register_forward_hook(record(key))
        model.head.register_forward_hook(lambda m, a, o: seen.setdefault("logits", []).append(
            [type(o).__name__, _placements(o), list(o.shape),
             list(o.to_local().shape) if isinstance(o, DTensor) else None, []]))
        with loss_context(par):
            loss = _loss(model, name)
            loss.backward()
        grads = {}
        for pname, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[pname] = rows.to_model(pname, g).tolist()
        with loss_context(par, label_smoothing=0.1), torch.no_grad():  # not supported by loss_parallel: gathered
            smoothed = float(_loss(model, name, 0.1))
        out[name] = {"loss": float(loss), "grads": grads, "seen": seen, "smoothed": smoothed}
    # dropout on the sequence-sharded stream (random ops on DTensors) runs and trains
    model = build_model(dataclasses.replace(_cfg("decoder"), dropout=0.1), seed=0)
    apply_tp(model, mesh["tp"], 2)
    with loss_context(par):
        loss = _loss(model, "decoder")
        loss.backward()
    out["dropout_grads_finite"] = all(bool(torch.isfinite(p.grad.to_local() if isinstance(p.grad, DTensor)
                                                           else p.grad).all()) for p in model.parameters())
    write_json(Path(tmp) / f"rank{rank}.json", out)


def test_sequence_parallel_norms_and_loss_parallel_match_the_full_model(tmp_path):
    run_ranks(2, _on_rank, str(tmp_path))
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in range(2)]
    assert ranks[0]["dropout_grads_finite"] and ranks[1]["dropout_grads_finite"]
    for name in CONFIGS:
        model = build_model(_cfg(name), seed=0)
        loss = _loss(model, name)
        loss.backward()
        with torch.no_grad():
            smoothed = float(_loss(model, name, 0.1))
        src_len, tgt_len = 7, 5
        for got in (r[name] for r in ranks):
            assert abs(got["loss"] - float(loss)) <= 1e-5 * abs(float(loss)), name
            assert abs(got["smoothed"] - smoothed) <= 1e-5 * smoothed, name
            for pname, p in model.named_parameters():
                g = torch.tensor(got["grads"][pname])
                assert torch.linalg.norm(g - p.grad) <= 1e-5 * torch.linalg.norm(p.grad) + 1e-8, (name, pname)
        # every norm (and so the residual stream around it) reads this rank's slice of the sequence
        norms = [key for key, _ in _norms(model)]
        assert len(norms) == (2 * 2 + 1 if name != "encoder-decoder" else (2 * 2 + 1) + (3 * 2 + 1))
        for key in norms:
            full = src_len if key.startswith("encoder") else tgt_len
            local = []
            for r in ranks:
                kind, placements, shape, local_shape, (out_kind, out_shape) = r[name]["seen"][key][0]
                assert (kind, placements) == ("DTensor", ["Shard(1)"]), key
                assert shape == [2, full, 32] and out_shape == [2, full, 32], key
                # a block's norm hands on the shard; a stack's final norm's output is gathered whole
                assert out_kind == ("Tensor" if key.endswith("final_norm") else "DTensor"), key
                local.append(local_shape[1])
            assert local == [(full + 1) // 2, full // 2], key  # uneven: 4 + 3, 3 + 2
        # the training loss read vocabulary shards: Shard(-1) of the (B, T, 30) logits, 15 columns each
        kind, placements, shape, local_shape, _ = ranks[0][name]["seen"]["logits"][0]
        assert (kind, placements) == ("DTensor", ["Shard(2)"])
        assert shape == [2, tgt_len, 30] and local_shape == [2, tgt_len, 15]
        # with label smoothing the head gathers: its second call gave whole logits
        assert ranks[0][name]["seen"]["logits"][1][:3] == ["Tensor", [], [2, tgt_len, 30]]
