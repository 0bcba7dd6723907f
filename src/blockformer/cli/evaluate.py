"""``blockformer eval --checkpoint DIR``: how good a trained model is.

Language models: loss and perplexity on the checkpoint's validation split, or on other
text with ``--data`` (masked-LM encoders: the loss and accuracy at masked positions). Task
heads: loss, accuracy, macro F1 and the confusion matrix on a labelled file (``--data``). Synthetic tasks: loss and exact match on the held-out split. Aligned
pairs: loss on the held-out pairs. (Translation quality, BLEU and chrF against reference
files, is computed by ``translation_metrics`` below when ``--src``/``--ref`` are given.)
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint or run directory")
    parser.add_argument("--data", metavar="SPEC",
                        help="language models: text to score (files, directories, globs, 'stdlib'; all of it "
                             "is scored); aligned pairs: SRC,TGT files (all held out); task heads: a labelled "
                             "file (text<TAB>label or JSONL). Default: the "
                             "validation split of 'stdlib' or of a synthetic task; a checkpoint never "
                             "chooses which local files are read")
    parser.add_argument("--batches", type=int, default=50, metavar="N", help="at most N batches (0 = all)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B", help="default: the run's")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    from .translate import add_decoding_arguments, add_quantize_argument  # noqa: PLC0415

    add_quantize_argument(parser)
    from ..generate.scoring import BLEU_TOKENIZERS  # noqa: PLC0415

    group = parser.add_argument_group("translation quality (encoder-decoders): sacreBLEU BLEU and chrF")
    group.add_argument("--src", metavar="F", help="source sentences to translate, one per line (.gz read directly)")
    group.add_argument("--ref", metavar="F", help="their reference translations, one per line")
    group.add_argument("--tokenize", default="13a", choices=BLEU_TOKENIZERS, help="sacreBLEU tokenizer (default 13a)")
    group.add_argument("--hyp-output", metavar="F", help="also write the translations to F")
    add_decoding_arguments(group, batch_default=None)  # --batch-size above: sentences per batch here (default 64)


def run(args: argparse.Namespace) -> int:
    import dataclasses  # noqa: PLC0415

    from ..generate.quantize import quantize  # noqa: PLC0415
    from ..train.load import load_checkpoint  # noqa: PLC0415
    from ..precision import autocast, check_precision, resolve_device  # noqa: PLC0415

    if args.batch_size is not None and not 1 <= args.batch_size <= 2**16:
        raise UsageError(f"--batch-size {args.batch_size}: expected an integer in [1, 65536]")
    if args.src or args.ref:
        from .translate import print_translation_metrics, translation_metrics  # noqa: PLC0415

        if not args.src:
            raise UsageError("--src: missing; expected the source sentences that --ref translates")
        metrics = translation_metrics(args)
        if args.json:
            print(json.dumps(metrics))
        else:
            print_translation_metrics(metrics)
        return 0
    if args.batches < 0:
        raise UsageError(f"--batches {args.batches}: expected an integer >= 0")
    device = resolve_device(args.device, "--device")
    check_precision(args.precision, device, "--precision")
    ckpt = load_checkpoint(args.checkpoint, device)
    quantize(ckpt.model, args.quantize)
    cfg = ckpt.config
    train_cfg = dataclasses.replace(
        cfg.train,
        eval_batches=args.batches or 10**9,
        batch_size=args.batch_size or cfg.train.batch_size,
        eval_samples=cfg.data.heldout,
    )
    with autocast(args.precision, device):
        if cfg.data.kind == "text":
            metrics = lm_metrics(ckpt, args.data, train_cfg, device)
        elif cfg.data.kind == "labelled":
            metrics = head_metrics(ckpt, train_cfg, device, args.data)
        elif cfg.data.kind == "dataset":  # images or signals: a data set a package ships
            if args.data:
                raise UsageError(f"--data: this checkpoint reads its data set, data.dataset={cfg.data.dataset!r}, "
                                 "from the package that ships it; expected no --data")
            metrics = dataset_metrics(ckpt, train_cfg, device)
        else:
            metrics = seq2seq_metrics(ckpt, train_cfg, device, args.data)
    from ..train.metrics import perplexity  # noqa: PLC0415

    if cfg.head.task == "none":  # a head's loss is no perplexity
        metrics["val_ppl"] = perplexity(metrics["val_loss"])
    if args.json:
        print(json.dumps(metrics))
    else:
        for key, value in metrics.items():
            print(f"{key:<12} {value:.4f}" if isinstance(value, float) else f"{key:<12} {value}")
    return 0


def lm_metrics(ckpt: Any, spec: str | None, train_cfg: Any, device: Any) -> dict[str, Any]:
    """Mean loss over windows of the validation split, or of all of ``spec``."""
    from ..data.lm import LMDataset  # noqa: PLC0415
    from ..data.token_file import TokenFile, build_token_file  # noqa: PLC0415
    from ..train.objective import LanguageModelling  # noqa: PLC0415
    from ..train.setup import default_cache_dir, text_spec  # noqa: PLC0415

    data = ckpt.config.data
    cache = default_cache_dir()  # never the checkpoint's data.cache_dir: a checkpoint is data, not instructions
    if spec is None:
        if data.text.strip() != "stdlib":
            raise UsageError(
                f"--data: missing; this checkpoint was trained on data.text={data.text!r}, which eval does "
                f"not read on the checkpoint's word; pass the text to score, e.g. --data {data.text}"
            )
        tokens = TokenFile(build_token_file(text_spec(data), ckpt.tokenizer, cache, max_bytes=data.max_bytes))
        val = LMDataset(tokens, data.seq_len, "val", data.val_fraction)
    else:
        items = [s.strip() for s in spec.split(",") if s.strip()]
        tokens = TokenFile(build_token_file(items[0] if len(items) == 1 else items, ckpt.tokenizer, cache))
        val = LMDataset(tokens, data.seq_len, "train", val_fraction=0.0)  # all of it
    from ..train.setup import objective_for  # noqa: PLC0415

    if objective_for(ckpt.config) == "mlm":
        from ..data.masking import MaskingRates  # noqa: PLC0415
        from ..train.mlm import MaskedLM  # noqa: PLC0415

        tc = ckpt.config.train
        rates = MaskingRates(tc.mask_rate, tc.mask_token_rate, tc.random_token_rate)
        objective = MaskedLM(val, val, train_cfg.batch_size, 0, device, ckpt.tokenizer.vocab_size, rates)
    else:
        objective = LanguageModelling(val, val, train_cfg.batch_size, 0, device)
    return {"tokens": len(val), **objective.evaluate(ckpt.model, train_cfg)}


def head_metrics(ckpt: Any, train_cfg: Any, device: Any, spec: str | None) -> dict[str, Any]:
    """Loss, accuracy, macro F1 and the confusion matrix on every example of the labelled
    file ``spec`` (read only when named here, never on the checkpoint's word)."""
    from ..data.describe import labelled_data  # noqa: PLC0415
    from ..data.labelled import read_labelled  # noqa: PLC0415
    from ..train.classify import TaskHead  # noqa: PLC0415

    cfg = ckpt.config
    if not spec:
        raise UsageError(f"--data: missing; expected the labelled file to score (this checkpoint was trained "
                         f"on data.labels={cfg.data.labels!r}, held out {cfg.data.val_labels or 'a share of it'!r})")
    data = labelled_data(cfg, read_labelled(spec, cfg.data.text_pair), ckpt.tokenizer, spec)
    objective = TaskHead(data, data, train_cfg.batch_size, 0, device)
    return objective.evaluate_full(ckpt.model, train_cfg.batch_size)


def dataset_metrics(ckpt: Any, train_cfg: Any, device: Any) -> dict[str, Any]:
    """On the validation split of ``data.dataset``: a head's loss, accuracy, macro F1 and
    confusion matrix, or an image-to-text model's loss and exact match (``predict --split
    test`` reads the test split)."""
    from ..train.setup import build_objective  # noqa: PLC0415

    objective = build_objective(ckpt.config, ckpt.tokenizer, device, log=lambda *a: None)
    if ckpt.config.head.task != "none":
        return objective.evaluate_full(ckpt.model, train_cfg.batch_size)
    return objective.evaluate(ckpt.model, train_cfg)


def seq2seq_metrics(ckpt: Any, train_cfg: Any, device: Any, spec: str | None = None) -> dict[str, Any]:
    """Held-out loss (and exact match for a synthetic task) as the trainer computes them;
    for aligned pairs, on the files ``spec`` = ``SRC,TGT`` (all of them)."""
    import dataclasses  # noqa: PLC0415

    from ..train.setup import build_objective  # noqa: PLC0415

    cfg = ckpt.config
    if cfg.data.kind == "task":
        if spec:
            raise UsageError("--data: a synthetic-task checkpoint generates its own held-out data; expected no --data")
    else:
        files = [s.strip() for s in (spec or "").split(",") if s.strip()]
        if len(files) != 2:
            named = f"{cfg.data.val_src or cfg.data.src},{cfg.data.val_tgt or cfg.data.tgt}"
            raise UsageError(f"--data {spec or ''}: expected SRC,TGT, the aligned files to score (this checkpoint "
                             f"was trained on {named}; eval does not read them on the checkpoint's word)")
        data = dataclasses.replace(cfg.data, src=files[0], tgt=files[1], val_src=files[0], val_tgt=files[1])
        cfg = dataclasses.replace(cfg, data=data)
    objective = build_objective(cfg, ckpt.tokenizer, device, log=lambda *a: None)
    return objective.evaluate(ckpt.model, train_cfg)

