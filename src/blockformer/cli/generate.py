"""``blockformer generate --checkpoint DIR --prompt TEXT``: continue a prompt, streaming.

Sampling (temperature, top-k, top-p, a seed) or greedy (``--temperature 0``) through the KV
cache; text is printed as it is generated, and stops at EOS, ``--max-new-tokens`` or a
``--stop`` string. ``--compile`` compiles the one-token decode step; ``--precision bf16``
and ``--quantize int8``/``int4``/``int4-a8``/``int8-a8`` make each step read fewer weight bytes (faster on a CPU),
and ``--kv-cache-dtype bf16``/``fp16`` fewer cache bytes (long contexts).
``--draft CKPT`` decodes speculatively: a small model with the same tokenizer proposes
``--num-draft`` tokens and the checkpoint verifies them in one pass (same output
distribution; greedy output identical); the acceptance rate goes to stderr.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .translate import add_kv_cache_argument, add_quantize_argument  # noqa: PLC0415

    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint or run directory")
    parser.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    parser.add_argument("--min-new-tokens", type=int, default=0, metavar="N", help="no EOS before N tokens")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, metavar="P", help="keep the nucleus of mass P")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop when the text contains TEXT (repeatable; TEXT is not printed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1, metavar="N")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--compile", action="store_true", help="compile the one-token decode step")
    add_kv_cache_argument(parser)
    add_quantize_argument(parser)
    parser.add_argument("--draft", default=None, metavar="CKPT",
                        help="speculative decoding: a small decoder checkpoint with the same tokenizer")
    parser.add_argument("--num-draft", type=int, default=None, metavar="K", help="tokens drafted per round (default 4)")


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from ..generate import TextStream, generate, prepare_for_decoding, speculative_generate  # noqa: PLC0415
    from ..tokenizers import EOS_ID  # noqa: PLC0415
    from ..train.load import load_checkpoint  # noqa: PLC0415
    from ..precision import check_precision, resolve_device  # noqa: PLC0415

    from ..generate.causal import MAX_NEW_TOKENS  # noqa: PLC0415
    from ..generate.sampling import MIN_TEMPERATURE  # noqa: PLC0415

    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: expected an integer in [1, {MAX_NEW_TOKENS}]")
    if not 0 <= args.min_new_tokens <= args.max_new_tokens:
        raise UsageError(f"--min-new-tokens {args.min_new_tokens}: expected 0..--max-new-tokens")
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < float("inf")):  # also refuses nan
        raise UsageError(f"--temperature {args.temperature}: expected 0 (greedy) or a finite float >= "
                         f"{MIN_TEMPERATURE:g} (smaller ones overflow the scaled logits)")
    if "" in args.stop:
        raise UsageError("--stop '': an empty stop string; expected some text to stop at")
    if args.num_draft is not None and not args.draft:
        raise UsageError(f"--num-draft {args.num_draft}: drafts tokens for --draft CKPT; "
                         f"expected --draft with it")
    args.num_draft = 4 if args.num_draft is None else args.num_draft
    if args.draft and (args.min_new_tokens or args.compile):
        raise UsageError("--draft: not combined with --min-new-tokens or --compile; expected neither")
    if args.num_draft < 1:
        raise UsageError(f"--num-draft {args.num_draft}: expected an integer >= 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: expected a float in (0, 1]")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k {args.top_k}: expected an integer >= 1")
    if not 1 <= args.num_samples <= 10_000:
        raise UsageError(f"--num-samples {args.num_samples}: expected an integer in [1, 10000]")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed {args.seed}: expected an integer in [0, 2**63)")
    device = resolve_device(args.device, "--device")
    check_precision(args.precision, device, "--precision")
    ckpt = load_checkpoint(args.checkpoint, device)
    if ckpt.config.head.task != "none":
        raise UsageError(f"--checkpoint {args.checkpoint}: a {ckpt.config.head.task} head; generate expects a "
                         "language model (use `blockformer predict`)")
    if ckpt.config.model.arch != "decoder":
        raise UsageError(
            f"--checkpoint {args.checkpoint}: an {ckpt.config.model.arch} model; generate expects a decoder "
            "(use `blockformer translate` for encoder-decoders)"
        )
    # one prompt at a time: a step has one row, or a speculative check's drafts and the token after them
    rows = args.num_draft + 1 if args.draft else 1
    model = prepare_for_decoding(ckpt.model, args.precision, args.quantize, pack=True, compiled=args.compile, rows=rows)
    draft = _load_draft(args, ckpt, device) if args.draft else None
    prompt_ids = ckpt.tokenizer.encode(args.prompt) or [EOS_ID]  # no prompt: a document starts after eos

    def write(row: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        stream = TextStream(ckpt.tokenizer.decode, write, args.stop)
        sys.stdout.write(args.prompt)
        generator = torch.Generator(device=device).manual_seed(args.seed + i)
        options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_id=EOS_ID,
                       generator=generator, on_token=stream.on_token, stop=stream.stop)
        if draft is None:
            generate(model, [prompt_ids], args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                     compile=args.compile, kv_cache_dtype=args.kv_cache_dtype, **options)
        else:
            out = speculative_generate(model, draft, [prompt_ids], args.max_new_tokens,
                                       num_draft=args.num_draft, kv_cache_dtype=args.kv_cache_dtype, **options)
            print(f"speculative: {out.accepted}/{out.proposed} drafted tokens accepted "
                  f"({out.acceptance_rate:.0%}), {out.target_calls} target passes", file=sys.stderr)
        stream.finish()
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def _load_draft(args: argparse.Namespace, ckpt, device):
    """The draft checkpoint, in the target's precision; it must share the tokenizer."""
    from ..generate import prepare_for_decoding  # noqa: PLC0415
    from ..train.load import load_checkpoint  # noqa: PLC0415

    draft = load_checkpoint(args.draft, device)
    if draft.config.model.arch != "decoder":
        raise UsageError(f"--draft {args.draft}: an {draft.config.model.arch} model; expected a decoder")
    probe = "The quick brown fox, 0123."
    same = draft.tokenizer.vocab_size == ckpt.tokenizer.vocab_size
    if not same or draft.tokenizer.encode(probe) != ckpt.tokenizer.encode(probe):
        raise UsageError(f"--draft {args.draft}: its tokenizer differs from --checkpoint's; expected the same one")
    return prepare_for_decoding(draft.model, args.precision, args.quantize, pack=True, rows=1)  # never compiled
