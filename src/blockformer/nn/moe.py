"""Mixture-of-experts FFN: each token goes through k of E expert FFNs, chosen by a router.

Parameters grow with E, compute per token with k (Shazeer et al. 2017; GShard, Lepikhin
et al. 2020; Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024). Token choice: the
router's softmax (in fp32) picks each token's top-k experts; for k > 1 their weights are
renormalised to sum to 1 (Mixtral), for k = 1 the raw probability is the weight (Switch),
so the router still gets a gradient from the task loss. Optional shared experts see every
token (DeepSeekMoE, Dai et al. 2024).

Two auxiliary losses keep the router healthy; each forward records them, weighted by
their coefficients, in ``aux_loss``, and the model's training loss adds
``auxiliary_loss(model)`` per target token (``models.base.with_auxiliary_loss``):

- load balancing ``E * sum_e f_e * P_e`` (Switch): ``f_e`` the fraction of tokens that chose
  expert e among their k, ``P_e`` the mean router probability of e, padding left out. It is
  k at perfect balance and grows as the load skews.
- router z-loss ``mean(logsumexp(logits)^2)`` (ST-MoE, Zoph et al. 2022): keeps logits small.

The experts run on tokens sorted by expert: one grouped matmul per projection
(``torch.nn.functional.grouped_mm``) when it applies, else a batched matmul over a padded
(E, capacity, d) buffer. With ``expert_capacity_factor > 0`` training gives each expert
``factor * tokens * k / E`` slots; assignments past them are dropped (first choices are
served before second choices, GShard) and a token with no slot left passes through the
residual only. Evaluation and decoding are always dropless, so a token's output does not
depend on the rest of the batch and cached decoding equals the full forward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GATED_FFNS, TransformerConfig
from .feedforward import FeedForward, activation


class MoEFeedForward(nn.Module):
    """``y = sum_{e in topk(x)} w_e(x) FFN_e(x) [+ FFN_shared(x)]`` at each position.

    Expert weights are stacked: ``w_up`` (E, d_model, d_ff or 2 d_ff for the gated kinds:
    gate then up), ``w_down`` (E, d_ff, d_model), so expert e of E=1 holds exactly the
    transposed weights of a dense ``FeedForward``.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        E, d, f = cfg.ffn_experts, cfg.d_model, cfg.expert_d_ff or cfg.d_ff
        self.n_experts, self.top_k, self.d_ff = E, cfg.experts_top_k, f
        self.gated = cfg.ffn in GATED_FFNS
        self.act = activation(cfg)  # the dense FFN's own choice (gelu_approximate included)
        self.capacity_factor = cfg.expert_capacity_factor
        self.aux_coef, self.z_coef = cfg.router_aux_coef, cfg.router_z_coef
        width = f * (2 if self.gated else 1)
        self.router = nn.Parameter(torch.empty(E, d))
        self.w_up = nn.Parameter(torch.empty(E, d, width))
        self.w_down = nn.Parameter(torch.empty(E, f, d))
        self.b_up = nn.Parameter(torch.zeros(E, width)) if cfg.bias else None
        self.b_down = nn.Parameter(torch.zeros(E, d)) if cfg.bias else None
        shared_cfg = dataclasses.replace(cfg, d_ff=cfg.shared_experts * f, ffn_experts=0) if cfg.shared_experts else None
        self.shared = FeedForward(shared_cfg) if shared_cfg is not None else None
        self.aux_loss: torch.Tensor | None = None  # the last forward's weighted auxiliary losses
        self.stats: dict[str, torch.Tensor] = {}  # the last forward's routing statistics
        self.reset_parameters(cfg.init_std, cfg.init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float, gain: float = 1.0) -> None:
        """Normal(0, std) router and up projections, Normal(0, out_std) down projections
        (the ones writing into the residual stream); ``gain`` scales the expert weights
        (DeepNet's beta)."""
        nn.init.normal_(self.router, 0.0, std)
        nn.init.normal_(self.w_up, 0.0, std).mul_(gain)
        nn.init.normal_(self.w_down, 0.0, out_std).mul_(gain)
        for b in (self.b_up, self.b_down):
            if b is not None:
                nn.init.zeros_(b)

    def no_weight_decay(self) -> list[nn.Parameter]:
        """The stacked biases are 2-D but are biases: the optimizer leaves them undecayed."""
        return [b for b in (self.b_up, self.b_down) if b is not None]

    # ------------------------------------------------------------------ routing
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits (N, E) in fp32, and each token's top-k weights and experts (N, k)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = x.float() @ self.router.float().t()
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, experts

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model); ``valid`` (B, T): True for real tokens
        (padding is routed nowhere, and left out of the losses and statistics)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        N, E, k = flat.shape[0], self.n_experts, self.top_k
        mask = None if valid is None else valid.reshape(-1).bool()
        logits, weights, experts = self.route(flat)
        self._record_losses(logits, experts, mask)
        # Assignments in priority order: every token's first choice, then every second... (GShard).
        expert_ids = experts.t().reshape(-1)  # (k N,)
        if mask is not None:
            expert_ids = torch.where(mask.repeat(k), expert_ids, E)  # padding: bucket E, never computed
        token_ids = torch.arange(N, device=x.device).repeat(k)
        gates = weights.t().reshape(-1)
        order = expert_ids.argsort(stable=True)
        sorted_experts, sorted_tokens, sorted_gates = expert_ids[order], token_ids[order], gates[order]
        counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(
            0, expert_ids, torch.ones_like(expert_ids)
        )
        xs = flat[sorted_tokens]  # (k N, d): tokens grouped by expert
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        w = (self.weight("w_up", dtype), self.weight("w_down", dtype))  # cast (or dequantized) once
        if self.training and self.capacity_factor > 0:
            capacity = max(1, math.ceil(self.capacity_factor * N * k / E))
            out, kept = self._padded(xs, sorted_experts, counts, capacity, w)
        elif _grouped_mm_ok(xs, *w, dtype):
            out, kept = self._grouped(xs, sorted_experts, counts, w), sorted_experts < E
        else:
            # Dropless without grouped_mm: one padded slot per token and expert is always enough
            # (top-k picks distinct experts); eagerly, only as many as the fullest expert needs.
            capacity = N if torch.compiler.is_compiling() else max(1, int(counts[:E].max()))
            out, kept = self._padded(xs, sorted_experts, counts, capacity, w)
        contribution = torch.where(kept[:, None], out * sorted_gates.to(out.dtype)[:, None], 0.0)
        y = torch.zeros(N, shape[-1], dtype=out.dtype, device=x.device).index_add_(0, sorted_tokens, contribution)
        self.stats = {
            "load": counts[:E].detach(),  # assignments each expert was chosen for
            "dropped": ((sorted_experts < E) & ~kept).sum().detach(),
            "assigned": counts[:E].sum().detach(),
        } | self.stats
        if self.shared is not None:
            y = y + self.shared(flat).to(y.dtype)
        return y.reshape(shape).to(x.dtype)

    def _record_losses(self, logits: torch.Tensor, experts: torch.Tensor, mask: torch.Tensor | None) -> None:
        E = self.n_experts
        m = torch.ones(logits.shape[0], device=logits.device) if mask is None else mask.float()
        n = m.sum().clamp(min=1.0)
        chosen = F.one_hot(experts, E).sum(dim=1).float()  # (N, E): 1 where e is among the top k
        f = (chosen * m[:, None]).sum(0) / n  # sums to k
        p = (logits.softmax(-1) * m[:, None]).sum(0) / n
        balance = E * (f * p).sum()
        z = (torch.logsumexp(logits, dim=-1) ** 2 * m).sum() / n
        self.aux_loss = self.aux_coef * balance + self.z_coef * z
        self.stats = {"balance_loss": balance.detach(), "z_loss": z.detach()}

    # ------------------------------------------------------------------ the experts
    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Expert matrix ``w_up`` or ``w_down`` in ``dtype``: the parameter, or after
        ``quantize_experts`` its int8 codes times their scales."""
        w = getattr(self, name, None)
        if w is not None:
            return w.to(dtype)
        return getattr(self, f"{name}_int8").to(dtype) * getattr(self, f"{name}_scales").to(dtype)

    @torch.no_grad()
    def quantize_experts(self) -> None:
        """Weight-only int8 for decoding (what ``generate.quantize`` does to every Linear):
        one scale per expert and output channel, ``q = round(w / s)``, ``s = max|w| / 127``.
        Stores a quarter of the fp32 bytes; each call dequantizes to the activation dtype."""
        for name in ("w_up", "w_down"):
            w = getattr(self, name)
            scales = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0  # (E, 1, out)
            codes = (w.float() / scales).round().clamp(-127, 127).to(torch.int8)
            delattr(self, name)
            self.register_buffer(f"{name}_int8", codes)
            self.register_buffer(f"{name}_scales", scales.to(w.dtype))

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, h = h.chunk(2, dim=-1)
            return self.act(gate) * h
        return self.act(h)

    def _grouped(self, xs: torch.Tensor, sorted_experts: torch.Tensor, counts: torch.Tensor,
                 w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One grouped matmul per projection over the sorted rows; padding rows (at the end)
        join the last group and are discarded by the caller."""
        E = self.n_experts
        offs = counts[:E].cumsum(0)
        offs = torch.cat([offs[:-1], offs.new_full((1,), xs.shape[0])]).to(torch.int32)
        expert_of_row = sorted_experts.clamp(max=E - 1)
        (w_up, w_down), dtype = w, w[0].dtype
        h = F.grouped_mm(xs.to(dtype), w_up, offs=offs)
        if self.b_up is not None:
            h = h + self.b_up.to(dtype)[expert_of_row]
        out = F.grouped_mm(self._ffn(h).contiguous(), w_down, offs=offs)
        if self.b_down is not None:
            out = out + self.b_down.to(dtype)[expert_of_row]
        return out

    def _padded(
        self, xs: torch.Tensor, sorted_experts: torch.Tensor, counts: torch.Tensor, capacity: int,
        w: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched matmuls over an (E, capacity, d) buffer; rows past an expert's capacity
        are dropped. Returns each sorted row's output and whether it was kept."""
        E, C, d = self.n_experts, capacity, xs.shape[-1]
        (w_up, w_down), dtype = w, w[0].dtype
        starts = counts.cumsum(0) - counts
        rank = torch.arange(xs.shape[0], device=xs.device) - starts[sorted_experts]
        kept = (rank < C) & (sorted_experts < E)
        slot = torch.where(kept, sorted_experts * C + rank, E * C)  # E * C: a slot for the rest
        buffer = torch.zeros(E * C + 1, d, dtype=dtype, device=xs.device).index_copy(0, slot, xs.to(dtype))
        h = torch.bmm(buffer[:-1].view(E, C, d), w_up)  # (E, C, width)
        if self.b_up is not None:
            h = h + self.b_up.to(dtype)[:, None]
        out = torch.bmm(self._ffn(h), w_down)  # (E, C, d)
        if self.b_down is not None:
            out = out + self.b_down.to(dtype)[:, None]
        out = torch.cat([out.reshape(E * C, d), out.new_zeros(1, d)])
        return out[slot], kept

    def extra_repr(self) -> str:
        cap = f"capacity_factor={self.capacity_factor}" if self.capacity_factor else "dropless"
        return f"experts={self.n_experts}, top_k={self.top_k}, d_ff={self.d_ff}, {cap}"


def _grouped_mm_ok(xs: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs here: it exists (torch >= 2.8), every row stride is
    16-byte aligned, and the dtype is one its kernel takes (bf16; fp32 on the CPU, except
    under torch.compile, whose shape check accepts only bf16 in torch 2.13)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if dtype != torch.bfloat16 and (xs.device.type != "cpu" or dtype != torch.float32 or torch.compiler.is_compiling()):
        return False
    size = torch.finfo(dtype).bits // 8
    return all((n * size) % 16 == 0 for n in (xs.shape[-1], w_up.shape[-1], w_down.shape[1], w_down.shape[-1]))


# ---------------------------------------------------------------------- what the trainer reads
def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def auxiliary_loss(model: nn.Module) -> torch.Tensor | None:
    """The mean over MoE layers of each one's weighted auxiliary losses from the last
    forward (the mean, so the coefficients do not scale with depth); None without MoE."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).mean() if losses else None


def routing_stats(model: nn.Module) -> dict[str, Any]:
    """The last forward's routing, for metrics.jsonl: each expert's share of the
    assignments (summed over layers), the fraction dropped, and the mean balance and
    z losses (unweighted). Empty without MoE."""
    layers = [m for m in moe_layers(model) if m.stats]
    if not layers:
        return {}
    load = torch.stack([m.stats["load"] for m in layers]).sum(0).float()
    assigned = float(sum(m.stats["assigned"] for m in layers))
    return {
        "expert_load": [round(v, 5) for v in (load / max(assigned, 1.0)).tolist()],
        "dropped": float(sum(m.stats["dropped"] for m in layers)) / max(assigned, 1.0),
        "balance_loss": float(torch.stack([m.stats["balance_loss"] for m in layers]).mean()),
        "z_loss": float(torch.stack([m.stats["z_loss"] for m in layers]).mean()),
    }
