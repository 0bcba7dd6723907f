"""How far past its training context a model reads: the position scheme decides.

Train the same small causal decoder at context T once per position scheme, on bytes of the
running Python's standard library, then measure its loss on windows of 1x, 2x, 4x and 8x T
held-out tokens. Schemes whose signal depends only on the offset between tokens and decays
or saturates with it (ALiBi, T5's bucketed bias, and to a degree none at all) keep their
loss; absolute signals see positions they were never trained on (sinusoids: new phases;
learned: no table entry at all, a "cannot extrapolate" row). RoPE sees new rotation angles.

Three ways to extend the trained RoPE model without retraining are measured beside it:
``rope_scaling="linear"`` (position interpolation, Chen et al. 2023) and ``"ntk"``
(NTK-aware base scaling), each with factor m at m x T, and a sliding window of T
(``attention_window``), which never shows a query a key further away than in training.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from ..config import TransformerConfig
from ..models import build_model
from ..errors import UsageError
from .report import ProbeResult, parse_ints, pick
from ..data.sources import iter_texts

SCHEMES = ["none", "sinusoidal", "learned", "rope", "alibi", "relative"]
EXTENSIONS = {"rope+linear": dict(rope_scaling="linear"), "rope+ntk": dict(rope_scaling="ntk"),
              "rope+window": dict(attention_window=-1)}  # -1: the training context


def corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard-library sources, as ids 0..255."""

    text, size = [], 0
    for piece in iter_texts("stdlib", max_bytes):
        text.append(piece)
        size += len(piece)
        if size >= max_bytes:
            break
    data = "".join(text).encode("utf-8")[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def train_lm(cfg: TransformerConfig, data: torch.Tensor, T: int, *, steps: int, batch_size: int, lr: float,
             seed: int) -> tuple[torch.nn.Module, float]:
    """AdamW with warmup and cosine decay on random windows of T tokens; the final loss
    (mean of the last 10 steps)."""
    model = build_model(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    warmup, losses = max(1, steps // 10), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, len(data) - T - 1, (batch_size,), generator=g)
        window = torch.stack([data[s : s + T + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    tail = losses[-10:]
    return model.eval(), sum(tail) / len(tail)


@torch.no_grad()
def position_loss(model: torch.nn.Module, windows: torch.Tensor, length: int) -> list[float]:
    """Mean loss at each position 0..length-1 over the rows of ``windows`` (N, L + 1), reading
    the last ``length`` + 1 bytes of each: every length predicts the same final bytes."""
    start = windows.shape[1] - 1 - length
    x, y = windows[:, start : start + length], windows[:, start + 1 : start + length + 1]
    loss = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # (N, length)
    return loss.mean(0).tolist()


def verdict(losses: list[float | None]) -> str:
    """``holds`` (at most +10% over 1x at the longest length), ``degrades`` (+50%), ``blows up``."""
    if any(v is None for v in losses):
        return "cannot extrapolate"
    ratio = losses[-1] / losses[0]
    return "holds" if ratio <= 1.1 else "degrades" if ratio <= 1.5 else "blows up"


def run(
    schemes: str | list[str] = ",".join(SCHEMES),
    train_len: int = 32,
    factors: str | list[int] = "1,2,4,8",
    steps: int = 300,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    batch_size: int = 16,
    lr: float = 3e-3,
    text_kb: int = 2000,
    eval_windows: int = 64,
    extensions: bool = True,
    seed: int = 0,
) -> ProbeResult:
    """Loss on the same ``train_len`` held-out bytes read at positions (m-1)T..mT-1 (after
    m x T - T bytes of context), for each scheme and each factor m."""
    for name, value, low in (("--train-len", train_len, 2), ("--steps", steps, 1), ("--eval-windows", eval_windows, 1),
                             ("--text-kb", text_kb, 1)):
        if value < low:
            raise UsageError(f"{name} {value}: expected an integer >= {low}")
    max_bytes = 1000 * text_kb
    schemes = pick(schemes, SCHEMES, "--schemes")
    factors = sorted(parse_ints(factors, "--factors"))
    T, longest = train_len, max(factors) * train_len
    data = corpus(max_bytes)
    split = int(0.9 * len(data))
    if len(data) - split < longest + 1 or split < T + 2:
        raise UsageError(f"--text-kb {text_kb}: too little text for held-out windows of {longest + 1} bytes")
    g = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(split, len(data) - longest - 1, (eval_windows,), generator=g).tolist()
    held_out = torch.stack([data[s : s + longest + 1] for s in starts])
    runs: dict[str, dict[str, Any]] = {}
    for scheme in schemes:
        cfg = TransformerConfig(arch="decoder", vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                max_seq_len=T if scheme == "learned" else longest, position=scheme, bias=False)
        model, final = train_lm(cfg, data[:split], T, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
        runs[scheme] = _measure(lambda m: model if m * T <= cfg.max_seq_len else None, held_out, T, factors)
        runs[scheme]["train_loss"] = final
        if scheme == "rope" and extensions:
            for name, change in EXTENSIONS.items():
                runs[name] = _measure(_extended(model, cfg, change, T), held_out, T, factors)
                runs[name]["train_loss"] = final
    rows = [[name, *r["loss"], verdict(r["loss"])] for name, r in runs.items()]
    return ProbeResult(
        name="length",
        claim="relative schemes that decay with distance (ALiBi, T5 buckets) hold their loss past the training "
        "context; absolute positions do not (learned ones cannot even be evaluated there)",
        columns=["position", *[f"{m}x T" for m in factors], "at the longest"],
        rows=rows,
        data={"train_len": T, "factors": factors, "steps": steps, "d_model": d_model, "n_layers": n_layers,
              "text_kb": text_kb, "eval_windows": eval_windows, "seed": seed, "runs": runs},
        notes=[
            f"Byte-level decoders ({n_layers} blocks, width {d_model}) trained {steps} steps at context T = {T} on "
            f"stdlib sources; each cell: mean loss (nats/byte) on the same T bytes of each of {eval_windows} held-out "
            "passages, read at positions (m-1)T..mT-1 after m x T - T bytes of context: every column after 1x reads "
            "positions past training, and the columns differ only in that.",
            "holds: longest <= 1.1 x the 1x loss; degrades: <= 1.5 x; blows up: more.",
            "rope+linear / rope+ntk: the trained rope model with rope_scaling=linear / ntk and factor m at m x T; "
            "rope+window: the same model with attention_window = T. No retraining.",
        ],
        plotter=plot,
    )


def _extended(model, cfg: TransformerConfig, change: dict[str, Any], T: int):
    """For factor m: the trained model rebuilt with ``change`` (rope scaling by m, or a window of T)."""
    state = model.state_dict()

    def at(m: int):
        kw = dict(change)
        if "rope_scaling" in kw:
            kw = dict(rope_scaling="none") if m == 1 else dict(kw, rope_scaling_factor=float(m))
        if kw.get("attention_window") == -1:
            kw["attention_window"] = T
        extended = build_model(dataclasses.replace(cfg, **kw))
        extended.load_state_dict(state)
        return extended.eval()

    return at


def _measure(model_at, held_out: torch.Tensor, T: int, factors: list[int]) -> dict[str, Any]:
    losses, curves = [], {}
    for m in factors:
        model = model_at(m)
        if model is None:
            losses.append(None)
            continue
        curve = position_loss(model, held_out, m * T)
        curves[m] = curve
        losses.append(sum(curve[-T:]) / T)
    return {"loss": losses, "curves": curves}


def plot(result: ProbeResult, fig: Any) -> None:
    """Loss per position at the longest length, smoothed over T/2 positions."""
    ax = fig.subplots()
    data = result.data
    T, longest = data["train_len"], max(data["factors"])
    k = max(1, T // 2)
    for name, r in data["runs"].items():
        curve = r["curves"].get(longest) or r["curves"].get(str(longest))
        if curve is None:
            curve = r["curves"][max(r["curves"], key=int)]
        smooth = [sum(curve[max(0, i - k + 1) : i + 1]) / len(curve[max(0, i - k + 1) : i + 1]) for i in range(len(curve))]
        ax.plot(range(1, len(curve) + 1), smooth, label=name, ls="--" if "+" in name else "-")
    ax.axvline(T, color="0.5", ls=":", label=f"training context T = {T}")
    ax.set_xscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("loss (nats/byte), smoothed")
    ax.set_title(f"loss per position, windows of {longest} x T", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
