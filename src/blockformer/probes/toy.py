"""The seed's worked example, run through the real ``Block`` step by step.

With d_model=2 and LayerNorm (gamma=1, beta=0, negligible eps), ``x = [1, 2]``: the
attention sublayer is replaced by one that returns ``A = [0.4, -0.2]`` and the FFN by one
that returns ``F = [0.3, 0.5]``. Pre-Norm gives ``Norm(x) = [-1, 1]``, ``r = x + A =
[1.4, 1.8]``, ``Norm(r) = [-1, 1]``, ``y = r + F = [1.7, 2.3]``. Post-Norm, on the same input,
normalises each sum instead: ``r' = Norm(x + A) = [-1, 1]``, ``y' = Norm(r' + F) = [-1, 1]``.

Every value is read from the block's own modules with forward hooks, not recomputed here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import TransformerConfig
from ..errors import UsageError
from ..nn.block import Block
from .report import ProbeResult

X = [1.0, 2.0]
A = [0.4, -0.2]
F = [0.3, 0.5]

# Pre-Norm: r = x + Attn(Norm(x)); y = r + FFN(Norm(r)). The seed's numbers.
PRE_STEPS = [
    ("x", "input", X),
    ("Norm(x)", "attn_norm", [-1.0, 1.0]),
    ("A = Attn(Norm(x))", "attn", A),
    ("r = x + A", "attn_residual", [1.4, 1.8]),
    ("Norm(r)", "ffn_norm", [-1.0, 1.0]),
    ("F = FFN(Norm(r))", "ffn", F),
    ("y = r + F", "ffn_residual", [1.7, 2.3]),
]
# Post-Norm: r' = Norm(x + Attn(x)); y' = Norm(r' + FFN(r')). Hand arithmetic: with two
# features LayerNorm maps any (a, b) with a < b to (-1, 1).
POST_STEPS = [
    ("x", "input", X),
    ("A = Attn(x)", "attn", A),
    ("x + A", "attn_residual", [1.4, 1.8]),
    ("r' = Norm(x + A)", "attn_norm", [-1.0, 1.0]),
    ("F = FFN(r')", "ffn", F),
    ("r' + F", "ffn_residual", [-0.7, 1.5]),
    ("y' = Norm(r' + F)", "ffn_norm", [-1.0, 1.0]),
]


class FixedOutput(nn.Module):
    """A sublayer that ignores its input and returns one vector at every position.

    Called as ``attn(h, ctx)`` or ``ffn(h)``, like the sublayers it replaces."""

    def __init__(self, value: list[float]) -> None:
        super().__init__()
        self.register_buffer("value", torch.tensor(value, dtype=torch.float64))

    def forward(self, h: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return self.value.to(h.dtype).expand_as(h)


def toy_block(norm_position: str, dtype: torch.dtype = torch.float64) -> Block:
    """A d_model=2 block with LayerNorm(gamma=1, beta=0, eps=1e-12) and fixed sublayers."""
    cfg = TransformerConfig(
        arch="encoder", d_model=2, n_heads=1, norm="layer", norm_eps=1e-12, norm_position=norm_position
    )
    block = Block(cfg)
    block.attn, block.ffn = FixedOutput(A), FixedOutput(F)
    for norm in (block.attn_norm, block.ffn_norm):
        nn.init.ones_(norm.weight)
        nn.init.zeros_(norm.bias)
    return block.to(dtype).eval()


def trace_block(block: Block, x: torch.Tensor) -> dict[str, list[float]]:
    """Run ``block`` on ``x`` (1, 1, 2) and read each named submodule's output by a hook."""
    outputs: dict[str, list[float]] = {"input": x.flatten().tolist()}
    names = ("attn_norm", "attn", "attn_residual", "ffn_norm", "ffn", "ffn_residual")
    handles = []
    for name in names:
        def hook(module: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
            outputs[name] = out.detach().flatten().tolist()

        handles.append(getattr(block, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            outputs["output"] = block(x).flatten().tolist()
    finally:
        for h in handles:
            h.remove()
    return outputs


def run(dtype: str = "float64") -> ProbeResult:
    """Both blocks on ``x = [1, 2]``; every step's value, the expected one and their error."""
    dtypes = {"float64": torch.float64, "float32": torch.float32}
    if dtype not in dtypes:
        raise UsageError(f"--dtype {dtype}: expected float64 or float32")
    torch_dtype = dtypes[dtype]
    x = torch.tensor(X, dtype=torch_dtype).view(1, 1, 2)
    data: dict[str, Any] = {}
    rows = []
    for label, steps in (("pre", PRE_STEPS), ("post", POST_STEPS)):
        trace = trace_block(toy_block(label, torch_dtype), x)
        got = [trace[module] for _, module, _ in steps]
        errors = [max(abs(a - b) for a, b in zip(g, want)) for g, (_, _, want) in zip(got, steps)]
        data[label] = {
            "steps": [
                {"step": name, "module": module, "value": g, "expected": want, "error": e}
                for (name, module, want), g, e in zip(steps, got, errors)
            ],
            "output": trace["output"],
            "max_error": max(errors),
        }
        for (name, module, want), g, e in zip(steps, got, errors):
            rows.append([f"{label}-norm", name, module, _vec(g), _vec(want), e])
    return ProbeResult(
        name="toy",
        claim="the seed's worked example holds in the real Block: Pre-Norm y=[1.7, 2.3]; "
        "Post-Norm renormalises every sum",
        columns=["block", "step", "read from", "value", "expected", "error"],
        rows=rows,
        data=data,
        notes=[
            "Values are read from the block's modules with forward hooks (attention and FFN are "
            "replaced by fixed outputs).",
            "Pre-Norm keeps the residual stream [1, 2] -> [1.4, 1.8] -> [1.7, 2.3] un-normalised; "
            "Post-Norm's output is always a normalised vector: with 2 features LayerNorm gives [-1, 1].",
        ],
        plotter=plot,
    )


def _vec(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def plot(result: ProbeResult, fig: Any) -> None:
    """Each step's two features as bars, top to bottom, for both blocks."""
    axes = fig.subplots(1, 2, sharex=True)
    for ax, label in zip(axes, ("pre", "post")):
        steps = result.data[label]["steps"]
        ys = list(range(len(steps)))[::-1]
        for feature, offset, color in ((0, 0.18, "tab:blue"), (1, -0.18, "tab:orange")):
            values = [s["value"][feature] for s in steps]
            ax.barh([y + offset for y in ys], values, height=0.34, color=color, label=f"feature {feature}")
            for y, v in zip(ys, values):
                side = 1 if v >= 0 else -1
                ax.annotate(f"{v:.3g}", (v, y + offset), xytext=(3 * side, 0), textcoords="offset points",
                            ha="left" if side > 0 else "right", va="center", fontsize=8)
        ax.set_yticks(ys, [s["step"] for s in steps], fontsize=9)
        ax.axvline(0, color="0.5", lw=0.8)
        ax.set_xlim(-1.6, 3.6)
        ax.set_title(f"{label}-norm block: y = {_vec(result.data[label]['output'])}", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
