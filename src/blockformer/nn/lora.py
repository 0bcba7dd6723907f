"""LoRA: low-rank adapters on frozen projections (Hu et al. 2021).

A frozen ``W`` (out, in) learns an update ``scale * B A`` with ``A`` (r, in), ``B`` (out, r),
``B = 0`` at the start, so an adapted model begins exactly where its base stands.
``scale = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023), which keeps
the update's size from shrinking as the rank grows.

blockformer fuses some projections: ``qkv`` is one matrix, and the gated FFNs fuse
``gate`` and ``up`` into one ``up`` matrix of width ``2 * d_ff`` (gate rows first). An
adapter therefore targets a *row range* of its matrix: ``gate`` and ``up`` on a gated FFN
are two adapters on the two halves of the same ``nn.Linear``.

``LoRALinear`` is an ``nn.Linear`` that keeps the base ``weight``/``bias`` under their
own names, so the base checkpoint's keys load unchanged and the adapter tensors are just
the extra ``lora_A.*``/``lora_B.*``. ``merge`` folds the update into ``weight`` (for
inference, quantization, export); ``unmerge`` takes it out again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..schema import check_types
from .attention import Attention
from .dropout import Dropout
from .feedforward import FeedForward

LORA_MARK = "lora_"  # every adapter tensor's name contains it
LORA_TARGETS = ("qkv", "out", "up", "gate", "down")


@dataclass
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021): ``W x + (alpha / r) B A x`` on the chosen
    projections, ``B = 0`` at the start; only adapters (and a task head) train.

    The run config's ``[lora]`` section (``blockformer.run_config.LoraConfig`` is this class)."""

    rank: int = 0  # 0 = no adapters
    alpha: float = 16.0
    rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r (Kalajdzievski 2023)
    dropout: float = 0.0  # on the adapter's input
    targets: list[str] = field(default_factory=lambda: ["qkv", "out"])  # qkv, out, up, gate, down

    def __post_init__(self) -> None:
        check_types(self, "lora")
        if self.rank < 0:
            raise UsageError(f"lora.rank={self.rank!r}: expected an integer >= 0 (0 = off)")
        if self.alpha <= 0:
            raise UsageError(f"lora.alpha={self.alpha!r}: expected a float > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"lora.dropout={self.dropout!r}: expected a float in [0, 1)")
        bad = [t for t in self.targets if t not in LORA_TARGETS] if isinstance(self.targets, list) else [self.targets]
        if bad or not self.targets:
            raise UsageError(f"lora.targets={self.targets!r}: expected a non-empty list of {', '.join(LORA_TARGETS)}")


class LoRALinear(nn.Linear):
    """``y = x W^T + b + sum_parts scale * (drop(x) A_p^T B_p^T)`` written into the part's rows."""

    def __init__(self, base: nn.Linear, parts: dict[str, tuple[int, int]], rank: int, alpha: float,
                 rslora: bool = False, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: the base stays shared
        self.rank, self.parts = rank, dict(parts)
        self.alpha, self.rslora = alpha, rslora  # kept for export (interop.peft)
        self.scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        self.lora_dropout = Dropout(dropout)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, (start, stop) in self.parts.items():
            a = torch.empty(rank, self.in_features, device=base.weight.device, dtype=base.weight.dtype)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear (and PEFT) initialise A
            self.lora_A[name] = nn.Parameter(a)
            self.lora_B[name] = nn.Parameter(torch.zeros(stop - start, rank, device=a.device, dtype=a.dtype))
        self.merged = False

    def delta(self, name: str) -> torch.Tensor:
        """The update ``scale * B A`` of one part: (rows, in_features)."""
        return self.scale * low_rank_product(self.lora_B[name], self.lora_A[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.merged:
            return y
        h = self.lora_dropout(x)
        pieces = []
        for name, (start, stop) in self.parts.items():
            low = F.linear(F.linear(h, self.lora_A[name]), self.lora_B[name]) * self.scale  # (..., rows)
            pieces.append((start, stop, low))
        if len(pieces) == 1 and pieces[0][:2] == (0, self.out_features):
            return y + pieces[0][2]
        update = torch.zeros_like(y)
        for start, stop, low in pieces:
            update[..., start:stop] = low
        return y + update

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            for name, (start, stop) in self.parts.items():
                self.weight[start:stop] += self.delta(name).to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            for name, (start, stop) in self.parts.items():
                self.weight[start:stop] -= self.delta(name).to(self.weight.dtype)
            self.merged = False

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora rank={self.rank}, parts={list(self.parts)}, scale={self.scale:.3g}"


def lora_parts(module: nn.Module, targets: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """``{child name: {part: (first row, end row)}}``: where ``targets`` put adapters in one
    attention or FFN module (nothing for any other module)."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    if isinstance(module, Attention):
        if "qkv" in targets:
            for child in ("qkv", "q", "kv"):  # self-attention is fused; cross-attention is q + kv
                if isinstance(getattr(module, child, None), nn.Linear):
                    found[child] = {child: (0, getattr(module, child).out_features)}
        if "out" in targets:
            found["out"] = {"out": (0, module.out.out_features)}
    elif isinstance(module, FeedForward):
        d_up = module.up.out_features
        if module.gated:
            half = d_up // 2  # gate rows first (FeedForward chunks gate, then up)
            parts = {p: r for p, r in (("gate", (0, half)), ("up", (half, d_up))) if p in targets}
            if parts:
                found["up"] = parts
        elif "up" in targets:
            found["up"] = {"up": (0, d_up)}
        if "down" in targets:
            found["down"] = {"down": (0, module.down.out_features)}
    return found


def apply_lora(model: nn.Module, cfg: LoraConfig) -> int:
    """Put adapters on ``cfg.targets`` of every attention and FFN of ``model`` in place and
    freeze every other parameter of the body; returns the number of adapted matrices.
    ``gate`` needs a gated FFN (swiglu/geglu)."""
    if cfg.rank < 1:
        raise ValueError(f"lora.rank={cfg.rank}: expected an integer >= 1 to apply adapters")
    if "gate" in cfg.targets and not any(isinstance(m, FeedForward) and m.gated for m in model.modules()):
        raise ValueError("lora.targets: 'gate' needs a gated FFN (model.ffn='swiglu' or 'geglu')")
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for module in list(model.modules()):
        for child, parts in lora_parts(module, list(cfg.targets)).items():
            base = getattr(module, child)
            setattr(module, child, LoRALinear(base, parts, cfg.rank, cfg.alpha, cfg.rslora, cfg.dropout))
            count += 1
    if count == 0:
        raise ValueError(f"lora.targets={cfg.targets}: matched no projection of this model")
    return count


_CHUNK_ELEMENTS = 1 << 18  # 1 MiB of fp32 rows accumulated at a time: they stay in cache over the rank


def low_rank_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``b @ a`` for ``b`` (rows, r) and ``a`` (r, cols), rounded alike whatever block of rows
    is computed and on whatever CPU or device: merged weights are hashed (the base fingerprint
    of a LoRA checkpoint over another), and one process merges a weight whole while another
    composes the same rows a block at a time. A BLAS sums over the rank in an order that
    depends on the shape and the CPU (MKL on an AMD EPYC rounds 1-3 rows otherwise than the
    whole matrix), so the sum is taken here one rank-1 product at a time, in rank order, each
    product and each sum rounded once; in fp32 for lower precisions. 1.5x a matmul's time at
    rank 8 and 10x at rank 64 on a 4096 x 4096 weight (0.15 s on 2 cores), paid once per merge."""
    dtype = torch.promote_types(b.dtype, torch.float32)
    b, a = b.to(dtype), a.to(dtype)
    out = torch.empty(b.shape[0], a.shape[1], dtype=dtype, device=b.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, a.shape[1]))
    for first in range(0, b.shape[0], step):
        rows, o = b[first: first + step], out[first: first + step]
        torch.mul(rows[:, :1], a[:1], out=o)
        term = torch.empty_like(o)
        for k in range(1, a.shape[0]):
            o.add_(torch.mul(rows[:, k: k + 1], a[k: k + 1], out=term))
    return out


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (outputs unchanged, up to rounding)."""
    for layer in lora_layers(model):
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Take every merged adapter out of its base weight again."""
    for layer in lora_layers(model):
        layer.unmerge()
    return model


def unload_lora(model: nn.Module) -> nn.Module:
    """Merge, then replace each ``LoRALinear`` by a plain ``nn.Linear`` holding the merged
    weight: the model is then an ordinary blockformer model (quantizable, exportable)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                child.merge()
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device=child.weight.device, dtype=child.weight.dtype)
                plain.weight, plain.bias = child.weight, child.bias
                setattr(module, name, plain)
    return model


def adapter_state(model: nn.Module, extra_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``model`` (and those under ``extra_prefixes``, e.g. a task head)."""
    return {
        name: t.detach()
        for name, t in model.state_dict().items()
        if LORA_MARK in name or name.startswith(extra_prefixes)
    }
