"""Attention sees a set: without a position signal an encoder is permutation-equivariant.

For every architecture (encoder, causal decoder), position scheme and padding, the error
``max |model(permute(x)) - permute(model(x))|``. It is zero (to rounding) only for an encoder
with ``position="none"``: full visibility and no position signal means each token's output
depends on the *set* of tokens, so permuting the input just moves the outputs. Any position
signal breaks it, and so does the causal mask, which itself carries order. With padding,
the real tokens are permuted and the pads stay at the end: padding is invisible, so the
claim is about the real tokens' outputs only.

The order example: 小明打小红 ("Xiaoming hits Xiaohong") and 小红打小明 (the reverse) hold
the same characters; an order-blind encoder gives each character the same output in both.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import TransformerConfig
from ..models import build_model
from .report import ProbeResult, plot_label
from ..errors import UsageError

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "relative"]
ARCHS = ["encoder", "decoder"]
EQUAL, DIFFERENT = 1e-5, 1e-2  # the thresholds the claim is judged by
SENTENCE_A, SENTENCE_B = "小明打小红", "小红打小明"
SENTENCE_PERM = [3, 4, 2, 0, 1]  # B = A[perm]: 小红 moves to the front, 小明 to the back
SENTENCE_SETTINGS = [("encoder", "none"), ("encoder", "sinusoidal"), ("decoder", "none")]


def small_model(
    arch: str, position: str, *, init_std: float, seed: int, vocab_size: int = 64
) -> torch.nn.Module:
    """A 2-block model in float64 (so "equal" means rounding error, ~1e-15).

    ``init_std`` is larger than the training default (0.02): at 0.02 the attention scores are
    near zero, attention is near-uniform, and a position signal acting inside attention (rope)
    shifts the outputs by only ~1e-4, which would hide the effect a trained model shows.
    """
    cfg = TransformerConfig(
        arch=arch, vocab_size=vocab_size, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
        position=position, init_std=init_std,
    )
    return build_model(cfg, seed=seed).double().eval()


def permutation_error(model: torch.nn.Module, tokens: torch.Tensor, n_real: int, perm: torch.Tensor) -> float:
    """Max |f(x permuted) - f(x) permuted| over the real positions; pads (after ``n_real``)
    stay where they are and are masked out of attention."""
    B, T = tokens.shape
    full = torch.cat([perm, torch.arange(n_real, T)])  # pads do not move
    mask = None if n_real == T else (torch.arange(T) < n_real).expand(B, T)
    with torch.no_grad():
        ran_then_permuted = model(tokens, attention_mask=mask)[:, full]
        permuted_then_ran = model(tokens[:, full], attention_mask=mask)
    return (permuted_then_ran - ran_then_permuted)[:, :n_real].abs().max().item()


def sentence_errors(model: torch.nn.Module) -> list[float]:
    """For each character of sentence B: max |output in B - output of the same character in A|."""
    vocab = {ch: 4 + i for i, ch in enumerate(sorted(set(SENTENCE_A)))}
    a = torch.tensor([[vocab[ch] for ch in SENTENCE_A]])
    b = torch.tensor([[vocab[ch] for ch in SENTENCE_B]])
    with torch.no_grad():
        out_a, out_b = model(a)[0], model(b)[0]  # (T, vocab)
    return [(out_b[i] - out_a[j]).abs().max().item() for i, j in enumerate(SENTENCE_PERM)]


def run(
    seq_len: int = 8, pad: int = 2, batch_size: int = 2, init_std: float = 0.2, seed: int = 0
) -> ProbeResult:
    """The permutation error for each (architecture, position, padding) and the order example."""
    if seq_len - pad < 2:

        raise UsageError(f"--seq-len {seq_len} with --pad {pad}: expected at least 2 real tokens to permute")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 64, (batch_size, seq_len), generator=g)
    n_real = seq_len - pad
    perm = torch.randperm(n_real, generator=g)
    while torch.equal(perm, torch.arange(n_real)):  # a permutation that moves something
        perm = torch.randperm(n_real, generator=g)
    whole_perm = torch.cat([perm, torch.arange(n_real, seq_len)])
    padded = tokens.clone()
    padded[:, n_real:] = 0  # the pad id

    rows, grid = [], []
    for arch in ARCHS:
        for position in POSITIONS:
            model = small_model(arch, position, init_std=init_std, seed=seed)
            claim = "equal" if arch == "encoder" and position == "none" else "differs"
            for padding in (False, True):
                if padding:
                    err = permutation_error(model, padded, n_real, perm)
                else:  # the same permutation, over all positions
                    err = permutation_error(model, tokens, seq_len, whole_perm)
                holds = err < EQUAL if claim == "equal" else err > DIFFERENT
                grid.append({"arch": arch, "position": position, "padding": padding, "error": err,
                             "claim": claim, "holds": holds})
                rows.append([arch, position, "random, padded" if padding else "random", err, claim, holds])

    sentence = []
    for arch, position in SENTENCE_SETTINGS:
        errors = sentence_errors(small_model(arch, position, init_std=init_std, seed=seed))
        claim = "equal" if arch == "encoder" and position == "none" else "differs"
        holds = max(errors) < EQUAL if claim == "equal" else max(errors) > DIFFERENT
        sentence.append({"arch": arch, "position": position, "errors": errors, "max_error": max(errors),
                         "claim": claim, "holds": holds})
        rows.append([arch, position, f"{SENTENCE_A} / {SENTENCE_B}", max(errors), claim, holds])
    notes = [
        f"Thresholds: 'equal' holds below {EQUAL:g}, 'differs' above {DIFFERENT:g}; float64, "
        f"init_std={init_std} (peaked attention, as in a trained model).",
        f"Padded: {pad} masked pads at the end; only the {n_real} real tokens are permuted and compared.",
        f"{SENTENCE_A} / {SENTENCE_B}: the same characters in another order; the error compares each "
        "character's output in one sentence with the same character's output in the other.",
    ]
    return ProbeResult(
        name="equivariance",
        claim="without a position signal and with full visibility, permuting the input only permutes "
        "the output; a position signal or a causal mask breaks this",
        columns=["arch", "position", "input", "max error", "claim", "holds"],
        rows=rows,
        data={"grid": grid, "sentence": {"a": SENTENCE_A, "b": SENTENCE_B, "perm": SENTENCE_PERM,
                                          "settings": sentence},
              "perm": perm.tolist(), "seq_len": seq_len, "pad": pad, "init_std": init_std},
        notes=notes,
        plotter=plot,
    )


def plot(result: ProbeResult, fig: Any) -> None:
    """Left: the error per setting on a log scale, with the two thresholds. Right: the
    order example, per character."""
    ax, ax2 = fig.subplots(1, 2, width_ratios=[2, 1])
    grid = result.data["grid"]
    width = 0.2
    for k, (arch, padding) in enumerate([(a, p) for a in ARCHS for p in (False, True)]):
        errors = [max(g["error"], 1e-17) for g in grid if g["arch"] == arch and g["padding"] == padding]
        xs = [i + (k - 1.5) * width for i in range(len(POSITIONS))]
        ax.bar(xs, errors, width, label=f"{arch}{', padded' if padding else ''}")
    ax.axhline(EQUAL, color="green", ls="--", lw=1, label=f"equal below {EQUAL:g}")
    ax.axhline(DIFFERENT, color="red", ls="--", lw=1, label=f"differs above {DIFFERENT:g}")
    ax.set_yscale("log")
    ax.set_ylim(1e-17, 1e5)  # room for the legend above the bars
    ax.set_xticks(range(len(POSITIONS)), POSITIONS)
    ax.set_ylabel("max |f(permuted x) - permuted f(x)|")
    ax.set_title("permute then run vs run then permute", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    sentence = result.data["sentence"]
    chars = [plot_label(ch) for ch in sentence["b"]]
    for k, s in enumerate(sentence["settings"]):
        xs = [i + (k - 1) * 0.27 for i in range(len(chars))]
        ax2.bar(xs, [max(e, 1e-17) for e in s["errors"]], 0.27, label=f"{s['arch']}, {s['position']}")
    ax2.set_yscale("log")
    ax2.set_ylim(1e-17, 1e5)
    ax2.set_xticks(range(len(chars)), chars, fontsize=8, rotation=30)
    ax2.set_title("order example: each character of B vs A", fontsize=10)
    ax2.set_ylabel("output difference")
    ax2.legend(fontsize=7, loc="upper center")
