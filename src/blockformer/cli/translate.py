"""``blockformer translate --checkpoint DIR``: translate lines with an encoder-decoder.

One source sentence per line in, one translation per line out (stdin to stdout, or
``--input F --output F`` with a progress bar). Sentences are sorted by length and decoded
``--batch-size`` at a time, which wastes little on padding, then written back in input
order. Beam search by default (beam 4, GNMT length penalty alpha 0.6, as in Vaswani et al.
2017); ``--beam 1`` is greedy decoding. ``blockformer eval --src F --ref F`` scores the
same translations with sacreBLEU (``translation_metrics`` below).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import UsageError

Hyps = list[tuple[str, float]]  # (text, score), best first; greedy's score is nan
MAX_BEAM = 1024  # beyond this a typo, not a search
MAX_TOKENS = 2**20  # a cap on generated lengths: larger asks would only fail in the allocator


def add_decoding_arguments(parser: argparse.ArgumentParser, batch_default: int | None = 64) -> None:
    """The options translate and eval share: search, length limit, batching, device."""
    parser.add_argument("--beam", type=int, default=4, metavar="K", help="beam size; 1 = greedy (default 4)")
    parser.add_argument("--alpha", type=float, default=0.6,
                        help="GNMT length penalty ((5+|Y|)/6)^alpha; 0 = raw log-probability (default 0.6)")
    parser.add_argument("--max-len-a", type=float, default=0.0, metavar="A",
                        help="limit generated tokens to A * source tokens + B (with --max-len-b)")
    parser.add_argument("--max-len-b", type=int, default=None, metavar="B",
                        help="see --max-len-a; default limit: each source's length + 50")
    if batch_default is not None:
        parser.add_argument("--batch-size", type=int, default=batch_default, metavar="N",
                            help=f"sentences per batch, sorted by length (default {batch_default})")
    parser.add_argument("--compile", action="store_true", help="torch.compile the one-token decode step")
    add_kv_cache_argument(parser)


def add_quantize_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=["int8", "int4", "int4-a8", "int8-a8"], default=None,
                        help="weight-only int8 or int4 matmuls, or int4/int8 weights against activations rounded to "
                             "int8 (int4-a8, the fastest CPU kernel; int8-a8): faster decoding, slightly different "
                             "outputs")


def add_kv_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype`` (generate, serve, translate, eval): ``generate.step.resolve_kv_dtype`` reads it."""
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "int8"],
                        help="what the KV cache holds (auto: what attention computes in); bf16 or fp16 halve "
                             "its bytes, rounding keys and values; int8 quarters them, with a scale per slot and head")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="an encoder-decoder checkpoint or run directory")
    parser.add_argument("--input", default="-", metavar="F", help="source sentences, one per line (.gz read directly; default stdin)")
    parser.add_argument("--output", default="-", metavar="F", help="where translations go (default stdout)")
    add_decoding_arguments(parser)
    parser.add_argument("--n-best", type=int, default=1, metavar="N",
                        help="write the N best hypotheses per source as 'index<TAB>score<TAB>text' lines")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    add_quantize_argument(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------- the library part
def translate_nbest(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    n_best: int = 1,
    max_len_a: float = 0.0,
    max_len_b: int | None = None,
    batch_size: int = 64,
    compile: bool = False,
    kv_cache_dtype: str = "auto",
    progress: Callable[[int], object] | None = None,
) -> list[Hyps]:
    """The ``n_best`` best translations of each text, in input order.

    Texts are encoded (``ids + [eos]``, as in training), sorted longest first and decoded
    ``batch_size`` at a time; blank lines translate to blank lines without decoding.
    The length limit is the library's default (source + 50) unless ``max_len_a`` or
    ``max_len_b`` is given: then ``a * longest source in the batch + b`` per batch.
    ``progress(n)`` is called as each batch of ``n`` sentences finishes. ``kv_cache_dtype``: what
    the decoder's cache holds (``greedy_decode``).
    """
    from ..config import ADDITIVE_POSITIONS  # noqa: PLC0415
    from ..generate import beam_search, greedy_decode  # noqa: PLC0415
    from ..tokenizers import EOS_ID  # noqa: PLC0415

    _check_decoding(beam_size, alpha, n_best, max_len_a, max_len_b, batch_size)
    cfg = model.cfg
    table = cfg.max_seq_len if cfg.position in ADDITIVE_POSITIONS else None  # absolute positions end there
    ids = [tokenizer.encode(t) if t.strip() else [] for t in texts]
    if table is not None:
        cut = sum(len(s) > table - 1 for s in ids)
        if cut:
            warnings.warn(f"{cut} of {len(ids)} sources are longer than the model's position table allows "
                          f"({table - 1} tokens + eos, max_seq_len={table}); their ends were cut, as in training",
                          stacklevel=2)
        ids = [s[: table - 1] for s in ids]  # room for eos, as in training (overlong="clip")
    results: list[Hyps] = [[("", 0.0)] for _ in texts]
    order = sorted((i for i, s in enumerate(ids) if s), key=lambda i: -len(ids[i]))
    if progress is not None and len(order) < len(texts):
        progress(len(texts) - len(order))  # the blank lines are done already
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        sources = [ids[i] + [EOS_ID] for i in rows]
        max_len = None
        if max_len_b is not None or max_len_a > 0:
            max_len = max(1, int(max_len_a * max(map(len, sources)) + (max_len_b or 0)))
            max_len = min(max_len, table) if table is not None else max_len
        if beam_size == 1:
            outs = greedy_decode(model, sources, max_len=max_len, compile=compile, kv_cache_dtype=kv_cache_dtype)
            hyps = [[(out, math.nan)] for out in outs]
        else:
            found = beam_search(model, sources, beam_size=beam_size, alpha=alpha, max_len=max_len,
                                n_best=n_best, compile=compile, kv_cache_dtype=kv_cache_dtype)
            hyps = [[(h.tokens, h.score) for h in hs] for hs in found]
        for i, hs in zip(rows, hyps):
            results[i] = [(_one_line(tokenizer.decode(tokens)), score) for tokens, score in hs]
        if progress is not None:
            progress(len(rows))
    return results


def translate_texts(model: Any, tokenizer: Any, texts: Sequence[str], **options: Any) -> list[str]:
    """The best translation of each text, in input order (options: see ``translate_nbest``)."""
    return [hyps[0][0] for hyps in translate_nbest(model, tokenizer, texts, **options)]


def _one_line(text: str) -> str:
    """One output line per source: a generated line break would misalign the files."""
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def _check_decoding(beam: int, alpha: float, n_best: int, a: float, b: int | None, batch_size: int) -> None:
    if not 1 <= beam <= MAX_BEAM:
        raise UsageError(f"--beam {beam}: expected an integer in [1, {MAX_BEAM}] (1 = greedy)")
    if not 0 <= alpha < math.inf:
        raise UsageError(f"--alpha {alpha}: expected a finite float >= 0")
    if not math.isfinite(a) or (b is not None and b > MAX_TOKENS):
        raise UsageError(f"--max-len-a {a} --max-len-b {b}: expected a finite a and b <= {MAX_TOKENS}")
    if not 1 <= n_best <= beam:
        raise UsageError(f"--n-best {n_best}: expected an integer in [1, --beam={beam}]")
    if a < 0 or (b is not None and b < 0) or (a == 0 and b == 0):
        raise UsageError(f"--max-len-a {a} --max-len-b {b}: expected a >= 0, b >= 0 and a limit above 0")
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: expected an integer >= 1")


def decoding_options(args: argparse.Namespace) -> dict[str, Any]:
    """``translate_nbest`` keyword arguments from the shared command-line options."""
    return {"beam_size": args.beam, "alpha": args.alpha, "max_len_a": args.max_len_a,
            "max_len_b": args.max_len_b, "batch_size": args.batch_size, "compile": args.compile,
            "kv_cache_dtype": args.kv_cache_dtype}


def load_translator(checkpoint: str, device_name: str, precision: str, quantize: str | None = None,
                    pack: bool = False) -> Any:
    """The checkpoint, checked to be an encoder-decoder, its model stored in ``precision``
    and quantized or packed if asked (``prepare_for_decoding``)."""
    from ..generate.quantize import prepare_for_decoding  # noqa: PLC0415
    from ..train.load import load_checkpoint  # noqa: PLC0415
    from ..precision import check_precision, resolve_device  # noqa: PLC0415

    device = resolve_device(device_name, "--device")
    check_precision(precision, device, "--precision")
    ckpt = load_checkpoint(checkpoint, device)
    arch = ckpt.config.model.arch
    if arch != "encoder-decoder":
        raise UsageError(
            f"--checkpoint {checkpoint}: a {arch} model; translation needs an encoder-decoder "
            "(trained on data.src/data.tgt or a data.task); use `blockformer generate` for decoders"
        )
    prepare_for_decoding(ckpt.model, precision, quantize, pack=pack)
    return ckpt


# ---------------------------------------------------------------------- files and streams
def read_lines(path: str) -> list[str]:
    """The lines of ``path`` (``-`` = stdin; ``.gz`` decompressed), without line ends."""
    from ..data.seq2seq import _read_lines  # noqa: PLC0415 - the parallel corpus reader's checks

    if path == "-":
        return [line.rstrip("\r\n") for line in sys.stdin]
    return _read_lines(Path(path))


def _format(index: int, hyps: Hyps, n_best: int) -> Iterable[str]:
    if n_best == 1:
        yield hyps[0][0]
    else:
        yield from (f"{index}\t{score:.4f}\t{text}" for text, score in hyps)


def run(args: argparse.Namespace) -> int:
    from ..paths import check_output_file  # noqa: PLC0415

    options = decoding_options(args)
    _check_decoding(args.beam, args.alpha, args.n_best, args.max_len_a, args.max_len_b, args.batch_size)
    if args.output != "-":
        check_output_file(args.output, "--output")  # before translating, not after
    ckpt = load_translator(args.checkpoint, args.device, args.precision, args.quantize, pack=not args.compile)
    if args.input == "-" and sys.stdin.isatty():  # a person typing: answer each line as it comes
        for index, line in enumerate(sys.stdin):
            [hyps] = translate_nbest(ckpt.model, ckpt.tokenizer, [line.rstrip("\r\n")], n_best=args.n_best,
                                     **options)
            print("\n".join(_format(index, hyps, args.n_best)), flush=True)
        return 0
    texts = read_lines(args.input)
    to_file = args.output != "-"
    bar = None
    if to_file and not args.quiet:  # no bar when the translations themselves go to the terminal
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(texts), desc="translate", unit="sent", dynamic_ncols=True, file=sys.stderr)
    results = translate_nbest(ckpt.model, ckpt.tokenizer, texts, n_best=args.n_best,
                              progress=bar.update if bar is not None else None, **options)
    if bar is not None:
        bar.close()
    lines = [line for index, hyps in enumerate(results) for line in _format(index, hyps, args.n_best)]
    text = "".join(line + "\n" for line in lines)
    if to_file:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


# ---------------------------------------------------------------------- eval --src --ref
def translation_metrics(args: argparse.Namespace) -> dict[str, Any]:
    """``blockformer eval --src F --ref F``: translate ``--src`` and score it against
    ``--ref`` with detokenised, cased sacreBLEU and chrF, signatures included."""
    import time  # noqa: PLC0415

    from ..generate.scoring import translation_scores  # noqa: PLC0415

    from ..paths import check_output_file  # noqa: PLC0415

    if not args.ref:
        raise UsageError("--ref: missing; expected the reference translations of --src, one per line")
    if getattr(args, "hyp_output", None):
        check_output_file(args.hyp_output, "--hyp-output")
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        raise UsageError(f"{args.ref}: {len(references)} lines but {args.src} has {len(sources)}; expected aligned files")
    options = decoding_options(args)
    options["batch_size"] = 64 if args.batch_size is None else args.batch_size
    _check_decoding(args.beam, args.alpha, 1, args.max_len_a, args.max_len_b, options["batch_size"])
    ckpt = load_translator(args.checkpoint, args.device, args.precision, args.quantize, pack=not args.compile)
    t0 = time.perf_counter()
    hypotheses = translate_texts(ckpt.model, ckpt.tokenizer, sources, **options)
    seconds = time.perf_counter() - t0
    if getattr(args, "hyp_output", None):
        Path(args.hyp_output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    scores = translation_scores(hypotheses, references, args.tokenize)
    return {
        "bleu": scores["bleu"].score,
        "chrf": scores["chrf"].score,
        "bleu_signature": scores["bleu"].signature,
        "chrf_signature": scores["chrf"].signature,
        "bleu_summary": scores["bleu"].summary,
        "sentences": len(sources),
        "beam": args.beam,
        "alpha": args.alpha,
        "sentences_per_s": len(sources) / max(seconds, 1e-9),
    }


def print_translation_metrics(metrics: dict[str, Any]) -> None:
    """The human-readable report: sacreBLEU's lines with their signatures."""
    details = metrics["bleu_summary"].split(" ", 3)[-1]  # "BLEU = 37.87 70.4/46.4/... (BP = ...)"
    print(f"BLEU  {metrics['bleu']:.2f}  {metrics['bleu_signature']}")
    print(f"      {details}")
    print(f"chrF2 {metrics['chrf']:.2f}  {metrics['chrf_signature']}")
    search = "greedy" if metrics["beam"] == 1 else f"beam {metrics['beam']}, alpha {metrics['alpha']}"
    print(f"{metrics['sentences']} sentences, {search}, {metrics['sentences_per_s']:.1f} sentences/s")
