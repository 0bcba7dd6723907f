"""``blockformer generate --checkpoint DIR --prompt TEXT``: sample a continuation.

Plain sampling with the KV cache (temperature, top-k, top-p, a seed); the generation
package extends it (batches, stop strings, streaming, beam search).
"""

from __future__ import annotations

import argparse

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint or run directory")
    parser.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, metavar="P", help="keep the nucleus of mass P")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1, metavar="N")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from ..generate import generate  # noqa: PLC0415
    from ..tokenizers import EOS_ID  # noqa: PLC0415
    from ..train.checkpoint import load_checkpoint  # noqa: PLC0415
    from ..train.precision import resolve_device  # noqa: PLC0415

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: expected an integer >= 1")
    if args.temperature < 0:
        raise UsageError(f"--temperature {args.temperature}: expected a float >= 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: expected a float in (0, 1]")
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device)
    if ckpt.config.model.arch != "decoder":
        raise UsageError(
            f"--checkpoint {args.checkpoint}: an {ckpt.config.model.arch} model; generate expects a decoder "
            "(use `blockformer translate` for encoder-decoders)"
        )
    prompt_ids = ckpt.tokenizer.encode(args.prompt) or [EOS_ID]  # no prompt: a document starts after eos
    for i in range(args.num_samples):
        generator = torch.Generator(device=device).manual_seed(args.seed + i)
        [ids] = generate(ckpt.model, [prompt_ids], args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, eos_id=EOS_ID, generator=generator)
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(args.prompt + ckpt.tokenizer.decode(ids))
    return 0
