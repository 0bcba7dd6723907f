"""What attention costs, and why the Transformer suits parallel hardware.

1. One block against sequence length T. Attention compares every position with every
   other: the score matrix is (B, H, T, T), so its memory grows as T^2. The "math" path
   materialises it (scores, then probabilities); the fused kernel of
   ``scaled_dot_product_attention`` (flash attention, Dao et al. 2022) streams over key
   blocks with an online softmax and never holds it. Memory is counted deterministically
   from the tensors the ops create (``probes.memory``); times are medians of a few runs.
2. A Transformer block against ``torch.nn.LSTM`` of the same width, forward and backward
   over the same sequences. The LSTM's T steps depend on each other, each a small matmul
   over the batch; the block handles all T positions in a few large matmuls whose length
   does not depend on T. On a CPU with few cores the LSTM (fewer FLOPs) can be as fast;
   the sequential-steps column is what scales with parallel hardware.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import TransformerConfig
from ..nn.block import Block
from .memory import measure
from .report import ProbeResult, log_ratio_axes, parse_ints

MB = 2**20
PATHS = {"math": SDPBackend.MATH, "fused": SDPBackend.FLASH_ATTENTION}


def score_bytes(batch_size: int, n_heads: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one materialised (B, H, T, T) attention score tensor."""
    return batch_size * n_heads * seq_len * seq_len * torch.empty((), dtype=dtype).element_size()


def timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds of ``repeats`` calls, after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_vs_length(
    seq_lens: list[int], *, batch_size: int, d_model: int, n_heads: int, repeats: int, device: torch.device,
    time_it: bool = True,
) -> list[dict[str, Any]]:
    """Per T: analytic score bytes, and per attention path its peak memory and time (forward)."""
    cfg = TransformerConfig(arch="decoder", d_model=d_model, n_heads=n_heads, max_seq_len=max(seq_lens))
    block = Block(cfg).to(device).eval()
    out = []
    for T in seq_lens:
        x = torch.randn(batch_size, T, d_model, device=device)
        row: dict[str, Any] = {"seq_len": T, "score_bytes": score_bytes(batch_size, n_heads, T)}
        for name, backend in PATHS.items():
            def forward(backend: SDPBackend = backend) -> torch.Tensor:
                with torch.no_grad(), sdpa_kernel([backend]):
                    return block(x)

            row[name] = {**measure(forward), "seconds": timed(forward, repeats, device) if time_it else None}
        out.append(row)
    return out


def block_vs_lstm(
    seq_lens: list[int], *, batch_size: int, d_model: int, n_heads: int, repeats: int, device: torch.device
) -> list[dict[str, Any]]:
    """Per T: forward+backward seconds of a (causal) block and an LSTM of the same width."""
    cfg = TransformerConfig(arch="decoder", d_model=d_model, n_heads=n_heads, max_seq_len=max(seq_lens))
    block = Block(cfg).to(device)
    lstm = torch.nn.LSTM(d_model, d_model, batch_first=True).to(device)
    cell = lstm_cell(lstm)
    out = []
    for T in seq_lens:
        x = torch.randn(batch_size, T, d_model, device=device, requires_grad=True)
        xd = x.detach()
        with sdpa_kernel([SDPBackend.MATH]):  # attention as matmuls, which the counter sees
            block_steps, block_flops, _ = counted(block, lambda: block(xd))
        # The LSTM unrolled into its cell: each call needs the previous call's state.
        lstm_steps, lstm_flops, unrolled = counted(cell, lambda: unroll(cell, xd))
        unrolled_error = float((unrolled - lstm(xd)[0]).abs().max().detach())
        out.append({
            "seq_len": T,
            "block_seconds": timed(lambda: block(x).sum().backward(), repeats, device),
            "lstm_seconds": timed(lambda: lstm(x)[0].sum().backward(), repeats, device),
            # Sequential steps, counted: calls of the module that processes the sequence.
            "block_sequential_steps": block_steps,
            "lstm_sequential_steps": lstm_steps,
            # Forward FLOPs, counted by torch's FlopCounterMode (matmuls and attention).
            "block_forward_flops": block_flops,
            "lstm_forward_flops": lstm_flops,
            "lstm_unrolled_max_error": unrolled_error,  # the unrolled cell is the same LSTM
        })
    return out


def lstm_cell(lstm: torch.nn.LSTM) -> torch.nn.LSTMCell:
    """A cell sharing the (one-layer) LSTM's weights."""
    cell = torch.nn.LSTMCell(lstm.input_size, lstm.hidden_size).to(lstm.weight_ih_l0.device)
    cell.weight_ih, cell.weight_hh = lstm.weight_ih_l0, lstm.weight_hh_l0
    cell.bias_ih, cell.bias_hh = lstm.bias_ih_l0, lstm.bias_hh_l0
    return cell


def unroll(cell: torch.nn.LSTMCell, x: torch.Tensor) -> torch.Tensor:
    """The LSTM over ``x`` (B, T, d), one step at a time: (B, T, d) hidden states."""
    state, outs = None, []
    for t in range(x.shape[1]):
        state = cell(x[:, t], state)
        outs.append(state[0])
    return torch.stack(outs, dim=1)


def counted(module: torch.nn.Module, fn: Any) -> tuple[int, int, Any]:
    """(calls of ``module``, forward FLOPs, result) of running ``fn``."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    try:
        with FlopCounterMode(display=False) as flops:
            result = fn()
    finally:
        handle.remove()
    return len(calls), flops.get_total_flops(), result


def run(
    seq_lens: str | list[int] = "128,256,512,1024,2048",
    rnn_seq_lens: str | list[int] = "64,128,256,512",
    batch_size: int = 1,
    rnn_batch_size: int = 8,
    d_model: int = 256,
    n_heads: int = 4,
    repeats: int = 3,
    device: str = "cpu",
    time_it: bool = True,
) -> ProbeResult:
    """Memory and time of one block against T (math vs fused attention), and block vs LSTM."""
    seq_lens = parse_ints(seq_lens, "--seq-lens")
    rnn_seq_lens = parse_ints(rnn_seq_lens, "--rnn-seq-lens") if rnn_seq_lens else []
    dev = torch.device(device)
    attn = block_vs_length(seq_lens, batch_size=batch_size, d_model=d_model, n_heads=n_heads, repeats=repeats,
                           device=dev, time_it=time_it)
    rnn = block_vs_lstm(rnn_seq_lens, batch_size=rnn_batch_size, d_model=d_model, n_heads=n_heads,
                        repeats=repeats, device=dev) if (rnn_seq_lens and time_it) else []
    rows = []
    for i, r in enumerate(attn):
        growth = r["score_bytes"] / attn[i - 1]["score_bytes"] if i else None
        ms = {k: r[k]["seconds"] * 1e3 if r[k]["seconds"] is not None else None for k in PATHS}
        rows.append([r["seq_len"], r["score_bytes"] / MB, growth, r["math"]["peak_bytes"] / MB,
                     r["fused"]["peak_bytes"] / MB, ms["math"], ms["fused"]])
    columns = ["T", "scores MB", "x prev", "math peak MB", "fused peak MB", "math ms", "fused ms"]
    rnn_rows = [
        [r["seq_len"], r["block_sequential_steps"], r["lstm_sequential_steps"],
         r["block_forward_flops"] / 1e9, r["lstm_forward_flops"] / 1e9,
         r["lstm_forward_flops"] / r["lstm_sequential_steps"] / 1e6,
         r["block_seconds"] * 1e3, r["lstm_seconds"] * 1e3]
        for r in rnn
    ]
    rnn_columns = ["T", "block steps", "LSTM steps", "block GFLOP", "LSTM GFLOP", "LSTM MFLOP/step",
                   "block ms", "LSTM ms"]
    rnn_title = (f"Transformer block vs LSTM, width {d_model}, batch {rnn_batch_size}, forward+backward, "
                 f"{torch.get_num_threads()} thread(s) ({dev.type})")
    return ProbeResult(
        name="cost",
        claim="attention's score memory grows as T^2 (the fused kernel never materialises it); a Transformer "
        "layer processes all positions at once where an LSTM takes T sequential steps",
        columns=columns,
        rows=rows,
        more_tables=[(rnn_title, rnn_columns, rnn_rows)] if rnn else [],
        data={"attention": attn, "rnn": rnn, "batch_size": batch_size, "rnn_batch_size": rnn_batch_size,
              "d_model": d_model, "n_heads": n_heads, "device": dev.type, "threads": torch.get_num_threads()},
        notes=[
            f"One causal block (d_model {d_model}, {n_heads} heads, batch {batch_size}), forward. "
            "scores MB = B*H*T^2*4 bytes, one fp32 score tensor; 'x prev' = its growth from the "
            "previous T (4 when T doubles).",
            "peak MB = the most tensor memory alive at once, counted from the ops' outputs "
            "(deterministic). The math path holds the (B, H, T, T) scores and probabilities; the fused "
            "path holds neither.",
            "Block vs LSTM: 'steps' are the dependent steps of the computation (forward FLOPs). The "
            "block does all its work in one step of large matmuls, which more cores or a GPU split up; "
            "the LSTM does T steps of MFLOP-sized matmuls one after another, which no amount of hardware "
            "shortens. On a few CPU cores the LSTM's fewer FLOPs can still make it faster.",
        ],
        plotter=plot,
    )


def plot(result: ProbeResult, fig: Any) -> None:
    """Memory and time against T, and block vs LSTM time."""
    data = result.data
    attn, rnn = data["attention"], data["rnn"]
    axes = fig.subplots(1, 3 if rnn else 2)
    Ts = [r["seq_len"] for r in attn]
    axes[0].plot(Ts, [r["score_bytes"] / MB for r in attn], "k:", label="one (B,H,T,T) score tensor")
    for name, style in (("math", "C3o-"), ("fused", "C0o-")):
        axes[0].plot(Ts, [r[name]["peak_bytes"] / MB for r in attn], style, label=f"{name} path, peak")
        if attn[0][name]["seconds"] is not None:
            axes[1].plot(Ts, [r[name]["seconds"] * 1e3 for r in attn], style, label=f"{name} path")
    for ax, title, ylabel in ((axes[0], "tensor memory of one block (forward)", "MB"),
                              (axes[1], "time of one block (forward)", "ms")):
        log_ratio_axes(ax, title, "sequence length T", ylabel)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    if rnn:
        Tr = [r["seq_len"] for r in rnn]
        axes[2].plot(Tr, [r["block_seconds"] * 1e3 for r in rnn], "C0o-", label="Transformer block (1 step)")
        axes[2].plot(Tr, [r["lstm_seconds"] * 1e3 for r in rnn], "C2o-", label="LSTM (T steps)")
        log_ratio_axes(axes[2], f"fwd+bwd, batch {data['rnn_batch_size']}, {data['threads']} thread(s)",
                       "sequence length T", "ms")
        axes[2].set_xscale("log", base=2)
        axes[2].legend(fontsize=7)
