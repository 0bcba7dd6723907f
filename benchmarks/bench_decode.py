"""Greedy decode speed: blockformer (no cache / cache / compiled step / quantized /
speculative) against Hugging Face ``GPT2LMHeadModel.generate`` on the same shape, in the
same run, at batch 1 or ``--batch`` prompts at once (throughput = batch x tokens / time).

    python benchmarks/bench_decode.py                      # GPT-2 small shape, 256 new tokens
    python benchmarks/bench_decode.py --dtype bf16 --threads 2
    python benchmarks/bench_decode.py --dtype bf16 --batch 16 --skip nocache
    python benchmarks/bench_decode.py --layers 2 --d-model 128 --heads 4 --vocab 1000 --tokens 16  # smoke

Both models have random weights (speed does not depend on them) and the GPT-2 shape:
learned positions, GELU, LayerNorm, pre-norm, tied embeddings. Neither stops early:
blockformer has no EOS, Hugging Face gets ``min_new_tokens = max_new_tokens``.

What makes blockformer's per-token cost small: the KV cache is allocated once (Hugging
Face's grows by concatenation) and eager decoding on a CPU attends only over its written
slots; the decode step has fixed shapes, so ``torch.compile`` captures it once (and on CUDA
replays it as a CUDA graph, removing per-kernel launch overhead, which dominates at batch
1; on a CPU its kernels are called from C++, inductor's ``cpp_wrapper``, and
``compiled-python`` is the same step with torch's default Python wrapper); tokens stay on
the device, with no host sync per token. ``packed`` stores the matmul weights in oneDNN's
blocked layout once (``generate.pack_linears``, what the CLI does on a CPU): the same
products at up to twice the speed for the few rows of a decode step, output checked
identical to greedy here; where fp32 weights are not packed (AVX2), ``packed`` streams them
through blockformer's C kernel instead (``StreamedLinear``), which ``packed-compiled`` also
compiles. ``streamed`` and ``streamed-compiled`` take that C kernel on any CPU, to weigh
it against the CLI's pick on the CPU at hand. ``matmuls alone`` times just the step's products with
plain ``torch.mm``, the ceiling of the unpacked kernels. Reading fewer bytes per token also
helps on a CPU: the ``int8-*`` variants store the matmul weights as int8 with per-channel
scales (weight-only quantization, as gpt-fast does), 4x fewer weight bytes than fp32; the
``int4-*`` variants (groups of 128 weights sharing a scale and offset) 8x fewer; both
change the output a little. ``int4a8-*`` read the int4 variants' bytes but round the
activations to int8 as well (``--quantize int4-a8``), so that their kernel multiplies integers;
``int8a8-*`` do the same with the int8 variants' bytes (``--quantize int8-a8``).

``speculative`` decodes with a draft model (``generate.speculative``): the target's first
``--draft-layers`` blocks with its embeddings and head, verified ``--num-draft`` tokens at a
time; its output equals plain greedy's (checked here) and its acceptance rate is printed.
On random weights the acceptance rate says little about trained models (a random network's
upper blocks change its logits little, so a truncated one agrees with it unusually often);
``--checkpoint``/``--draft-checkpoint`` time a trained pair instead.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

import torch

from common import add_shape_args, cpu_kind, gpt2_config, hf_gpt2, timed

from blockformer.generate import generate, pack_linears, speculative_generate
from blockformer.generate.linears import load_operators_for, swap_linears
from blockformer.generate.packed import PackedLinear, StreamedLinear
from blockformer.generate.quantize import Int4A8Linear, Int4Linear, Int8A8Linear, Int8Linear, quantize
from blockformer.train.throughput import format_bytes_per_s, memory_bandwidth

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUANTIZED = {"int8": ("int8", Int8Linear), "int4": ("int4", Int4Linear), "int4a8": ("int4-a8", Int4A8Linear),
             "int8a8": ("int8-a8", Int8A8Linear)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per run")
    p.add_argument("--prompt", type=int, default=16, help="prompt length")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per variant (the best is kept)")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded at once")
    p.add_argument("--draft-layers", type=int, default=2, help="speculative: blocks of the target the draft keeps")
    p.add_argument("--num-draft", type=int, default=4, help="speculative: tokens drafted per round")
    p.add_argument("--checkpoint", default=None, help="time this trained decoder instead of random weights")
    p.add_argument("--draft-checkpoint", default=None, help="speculative: a trained draft for --checkpoint")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["nocache", "cache", "compiled", "compiled-python", "packed", "packed-compiled", "streamed",
                            "streamed-compiled", "matmuls",
                            "int8-cache", "int8-compiled", "int4-cache", "int4-compiled", "int4a8-cache",
                            "int4a8-compiled", "int8a8-cache", "int8a8-compiled", "speculative", "hf"],
                   help="variants to leave out (nocache is slow: it recomputes the whole sequence)")
    return p.parse_args()


def draft_from(target, layers: int):
    """The target's first ``layers`` blocks, its embeddings, final norm and head (copied)."""
    draft = copy.deepcopy(target)
    draft.decoder.blocks = draft.decoder.blocks[:layers]
    draft.cfg = dataclasses.replace(target.cfg, n_layers=layers)
    return draft


def load_pair(args, device, dtype):
    """(target, draft or None) from ``--checkpoint`` / ``--draft-checkpoint``."""
    from blockformer.train.load import load_checkpoint  # noqa: PLC0415

    target = load_checkpoint(args.checkpoint, device).model.to(dtype).eval()
    draft = load_checkpoint(args.draft_checkpoint, device).model.to(dtype).eval() if args.draft_checkpoint else None
    return target, draft


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype, n, B = torch.device(args.device), DTYPES[args.dtype], args.tokens, args.batch
    max_len = args.prompt + n
    results: dict[str, float] = {}
    notes: dict[str, str] = {}
    step_bytes: dict[str, int] = {}  # weight bytes a variant reads per decode step

    cfg = gpt2_config(args.layers, args.d_model, args.heads, args.vocab, max(1024, max_len))
    if args.checkpoint:
        ours, draft = load_pair(args, device, dtype)
        cfg = ours.cfg
        args.skip.append("hf")  # Hugging Face would need the same weights
    else:
        ours, draft = build_model_for(cfg, device, dtype), None
    prompt = torch.randint(0, cfg.vocab_size, (B, args.prompt), generator=torch.Generator().manual_seed(0))
    variants = {
        "nocache": dict(use_cache=False),
        "cache": dict(use_cache=True),
        "compiled": dict(use_cache=True, compile=True),
        "compiled-python": dict(use_cache=True, compile=True, compile_mode="default"),  # torch's own wrapper
        "packed": dict(use_cache=True),
        "packed-compiled": dict(use_cache=True, compile=True),
        "streamed": dict(use_cache=True),
        "streamed-compiled": dict(use_cache=True, compile=True),
        "int8-cache": dict(use_cache=True),
        "int8-compiled": dict(use_cache=True, compile=True),
        "int4-cache": dict(use_cache=True),
        "int4-compiled": dict(use_cache=True, compile=True),
        "int4a8-cache": dict(use_cache=True),
        "int4a8-compiled": dict(use_cache=True, compile=True),
        "int8a8-cache": dict(use_cache=True),
        "int8a8-compiled": dict(use_cache=True, compile=True),
    }
    float_model = ours
    greedy: list[list[list[int]]] = []  # plain greedy's tokens, decoded once if a check needs them

    def expected() -> list[list[int]]:
        if not greedy:
            greedy.append(generate(float_model, prompt, n, temperature=0))
        return greedy[0]

    for name, kw in variants.items():
        if name in args.skip:
            continue
        scheme, layer = QUANTIZED[name.split("-")[0]] if name.startswith("int") else (None, None)
        if scheme is not None and not any(type(m) is layer for m in ours.modules()):
            ours = quantize(copy.deepcopy(float_model), scheme)  # int8 / int4 weights, activations in --dtype
            torch._dynamo.reset()
        if name.startswith("packed"):  # the same weights laid out for the CPU's few-row kernels, as the CLI does
            ours = pack_linears(copy.deepcopy(float_model), compiled="compiled" in name)
        if name.startswith("streamed"):  # csrc/f32_matmul.c on any CPU, to weigh it against the CLI's pick
            ours = copy.deepcopy(float_model)
            swap_linears(ours, lambda m: StreamedLinear.of(m) if type(m) is torch.nn.Linear else None)
            load_operators_for(ours, StreamedLinear)  # as pack_linears does

        def run(tokens: int = n, kw=kw) -> list[list[int]]:
            out = generate(ours, prompt, tokens, temperature=0, **kw)
            assert len(out[0]) == tokens
            return out

        run(n if "compiled" in name else min(n, 8))  # warm-up (the compiled step's shapes depend on n)
        results[f"blockformer {name}"] = B * n / timed(run, device, args.repeats)
        step_bytes[f"blockformer {name}"] = weight_bytes(ours)
        if name.startswith(("packed", "streamed")):
            assert run() == expected(), "packed or streamed weights must give plain greedy's tokens"
            notes[f"blockformer {name}"] = "output identical to greedy"

    if "matmuls" not in args.skip:
        weights = matmul_weights(float_model)
        inputs = {w.shape[1]: torch.randn(B, w.shape[1], device=device, dtype=dtype) for w in weights}

        def run_floor() -> None:  # the step's matmuls alone, once per new token
            with torch.inference_mode():
                for _ in range(n):
                    for w in weights:
                        torch.mm(inputs[w.shape[1]], w.t())

        run_floor()
        name = "matmuls alone: plain torch.mm by every matmul weight, once per token"
        results[name] = B * n / timed(run_floor, device, args.repeats)
        step_bytes[name] = sum(w.numel() * w.element_size() for w in weights)
        notes[name] = f"{step_bytes[name] / 1e6:.0f} MB of weights per token; what the unpacked kernel allows"

    if "speculative" not in args.skip:
        target = float_model
        draft = draft if draft is not None else draft_from(target, args.draft_layers)
        spec = {}

        def run_spec() -> None:
            spec["out"] = speculative_generate(target, draft, prompt, n, num_draft=args.num_draft, temperature=0)

        run_spec()  # warm-up
        name = f"blockformer speculative (draft: {args.draft_layers} layers, k={args.num_draft})"
        if args.draft_checkpoint:
            name = f"blockformer speculative (draft: {args.draft_checkpoint}, k={args.num_draft})"
        results[name] = B * n / timed(run_spec, device, args.repeats)
        assert spec["out"].tokens == expected(), "speculative greedy must equal plain greedy"
        notes[name] = f"acceptance {spec['out'].acceptance_rate:.0%}, output identical to greedy"
    del ours, float_model

    if "hf" not in args.skip:
        hf = hf_gpt2(cfg, device, dtype).eval()
        ids = prompt.to(device)
        mask = torch.ones_like(ids)

        def run_hf(tokens: int = n) -> None:
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
                                  min_new_tokens=tokens, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + tokens

        run_hf(min(n, 8))
        results["hf GPT2LMHeadModel.generate"] = B * n / timed(run_hf, device, args.repeats)
        step_bytes["hf GPT2LMHeadModel.generate"] = sum(w.numel() * w.element_size() for w in matmul_weights(hf))

    hf_rate = results.get("hf GPT2LMHeadModel.generate")
    bandwidth = memory_bandwidth(device)
    lines = [f"greedy decode, batch {B}, prompt {args.prompt}, {n} new tokens, {args.layers} layers, "
             f"d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, {args.dtype}, {device}, "
             f"threads {torch.get_num_threads()}, best of {args.repeats}, torch {torch.__version__}"
             + (f", CPU {cpu_kind()}" if device.type == "cpu" else ""),
             f"memory bandwidth {format_bytes_per_s(bandwidth)} (streaming read, `blockformer info --peak`); "
             "weight reads = weight bytes per step x steps/s (the KV cache and activations not counted)",
             "", "| variant | tokens/s (all rows) | vs HF | weight reads | of bandwidth | note |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, rate in results.items():
        ratio = f"{rate / hf_rate:.2f}x" if hf_rate else "-"
        reads = step_bytes.get(name, 0) * rate / B  # one step per token of each row
        read_cols = f"{format_bytes_per_s(reads)} | {reads / bandwidth:.0%}" if reads else "- | -"
        lines.append(f"| {name} | {rate:.1f} | {ratio} | {read_cols} | {notes.get(name, '')} |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


def matmul_weights(model) -> list[torch.Tensor]:
    """The weights a decode step multiplies by: every ``nn.Linear`` (the blocks and the
    output head; the token embedding is a lookup). Hugging Face's GPT-2 keeps its block
    matmuls in ``Conv1D`` modules."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]


def weight_bytes(model) -> int:
    """The bytes a batch-1 decode step of ``model`` reads its matmul weights from: each
    float or packed linear's weight, each quantized one's codes and scales."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            parts = [m.weight, m.scales]
        elif isinstance(m, Int4Linear):
            parts = [m.codes, m.scales, m.zeros]
        elif isinstance(m, (torch.nn.Linear, PackedLinear)):
            parts = [m.weight]
        else:
            continue
        total += sum(p.numel() * p.element_size() for p in parts)
    return total


def build_model_for(cfg, device, dtype):
    from blockformer import build_model  # noqa: PLC0415

    return build_model(cfg, seed=0).to(device=device, dtype=dtype).eval()


if __name__ == "__main__":
    main()
