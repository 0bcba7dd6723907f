"""``blockformer convert``: Hugging Face checkpoints in and out.

    blockformer convert --from-hf path/to/hf-model --out runs/imported
    blockformer convert --to-hf runs/imported --out path/to/hf-export
    blockformer convert --to-peft runs/lora --out path/to/peft-adapter
    blockformer convert --from-peft path/to/peft-adapter --base path/to/hf-model --out runs/adapted
    blockformer convert --consolidate runs/llama/step-001000

``--out`` must be new or empty: it is written whole, and ``--overwrite`` replaces what it
held (a run directory, a checkpoint, anything), but never the source or a directory that
holds it or lies inside it.

Import writes an ordinary blockformer checkpoint (``generate``, ``translate``, ``eval``
read it); export writes ``config.json`` + ``model.safetensors`` (sharded past
``--max-shard-size``) + a ``README.md`` model card (+ the tokenizer) that
``transformers.AutoModelFor...from_pretrained`` loads. ``--from-hf`` also takes a name
(``gpt2``, ``org/name``) of a model in the local Hugging Face cache. Families: GPT-2, Llama/Mistral,
BERT, T5, BART, Marian (see the README's table).

LoRA adapters in PEFT's format (GPT-2, Llama, BERT; ``interop/peft.py``): ``--to-peft``
writes a LoRA run's adapter as ``adapter_config.json`` + ``adapter_model.safetensors``
(``--base`` sets ``base_model_name_or_path``); ``--from-peft`` imports ``--base`` and merges
the adapter into its weights: an ordinary checkpoint, as ``--from-hf`` writes.

``--consolidate`` writes ``model.safetensors`` into a parallel run's checkpoint from its
``dcp/`` shards (a run with ``train.consolidate=false`` leaves them alone), one tensor at a
time, so it needs memory for the largest tensor, not the model.
"""

from __future__ import annotations

import argparse

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "e.g. blockformer convert --from-hf ./all-MiniLM-L6-v2 --out runs/minilm"
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--from-hf", metavar="DIR|NAME", help="a Hugging Face model directory (config.json + weights), "
                       "or a model in the local Hugging Face cache (gpt2, org/name, org/name@revision; never downloaded)")
    group.add_argument("--to-hf", metavar="CKPT", help="a blockformer checkpoint or run directory")
    group.add_argument("--to-peft", metavar="CKPT", help="a LoRA run's checkpoint: its adapter as a PEFT adapter directory")
    group.add_argument("--from-peft", metavar="DIR", help="a PEFT LoRA adapter directory, merged into --base")
    group.add_argument("--consolidate", metavar="CKPT",
                       help="a parallel run's checkpoint: write its model.safetensors from its dcp/ shards (no --out)")
    parser.add_argument("--out", metavar="DIR", help="the directory to write (new or empty; required but with --consolidate)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what --out holds (never the source, nor a directory around or inside it)")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="--from-hf: a tokenizer.json to use when DIR has none (Marian ships only sentencepiece)")
    parser.add_argument("--base", metavar="DIR|NAME",
                        help="--from-peft: the Hugging Face model the adapter adapts (required); "
                        "--to-peft: the base_model_name_or_path to record (default: the adapter's base checkpoint)")
    parser.add_argument("--max-shard-size", metavar="SIZE",
                        help="--to-hf: shard the weights past SIZE (500MB, 2GB, or bytes; default 5GB), as transformers does")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415

    from ..interop import from_hf, to_hf  # noqa: PLC0415
    from ..interop.convert import check_target  # noqa: PLC0415
    from ..interop.hf_dir import DEFAULT_MAX_SHARD_SIZE, parse_size  # noqa: PLC0415
    from ..interop.hub import resolve_source  # noqa: PLC0415

    if args.consolidate is not None:
        return _consolidate(args)
    if args.out is None:
        raise UsageError("--out: required; expected the directory to write (new or empty)")
    if args.max_shard_size is not None and args.to_hf is None:
        raise UsageError("--max-shard-size: only with --to-hf; --from-hf writes a blockformer checkpoint")
    max_bytes = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, "--max-shard-size")
    if args.base is not None and args.from_peft is None and args.to_peft is None:
        raise UsageError("--base: only with --from-peft or --to-peft")
    if args.to_peft is not None:
        return _to_peft(args)
    if args.from_peft is not None and args.base is None:
        raise UsageError("--from-peft: needs --base DIR, the Hugging Face model the adapter was trained on")
    # A name in the local Hugging Face cache is its snapshot directory from here on.
    source = Path(args.to_hf) if args.to_hf is not None else resolve_source(args.from_hf or args.base)
    # Checked before converting: --out is replaced whole, so it must hold nothing the user keeps.
    check_target(Path(args.out), source, overwrite=args.overwrite, flag="--out")
    if args.from_peft is not None:
        check_target(Path(args.out), Path(args.from_peft), overwrite=args.overwrite, flag="--out")
    if args.to_hf is not None:
        if args.tokenizer:
            raise UsageError("--tokenizer: only with --from-hf; --to-hf writes the checkpoint's own tokenizer")
        out = to_hf(args.to_hf, args.out, overwrite=args.overwrite, max_shard_size=max_bytes)
        print(f"wrote a Hugging Face model -> {out}")
        return 0
    from ..run_config import DataConfig, HeadConfig, RunConfig  # noqa: PLC0415
    from ..train.checkpoint import save_checkpoint  # noqa: PLC0415

    imported = from_hf(source, tokenizer=args.tokenizer)
    if args.from_peft is not None:
        imported = _merged_peft(args.from_peft, imported)
    if imported.tokenizer is None:
        raise UsageError(
            f"{source}: no tokenizer.json; a blockformer checkpoint needs one: pass --tokenizer FILE "
            "(for Marian, a tokenizer.json made from its sentencepiece files, e.g. by `tokenizers`)"
        )
    # Training or evaluating from this checkpoint uses its tokenizer and fits its position table.
    data = DataConfig(tokenizer=str(Path(args.out).resolve()), seq_len=min(DataConfig.seq_len, imported.config.max_seq_len))
    run_cfg = RunConfig(model=imported.config, data=data, head=imported.head or HeadConfig())  # a task head: predict reads it
    out = save_checkpoint(args.out, imported.model, imported.tokenizer, run_cfg)
    from ..serve.engine import chat_template_of  # noqa: PLC0415

    template = chat_template_of(source)
    if template is not None:  # `blockformer serve` answers /v1/chat/completions with it
        (Path(out) / "chat_template.jinja").write_text(template, encoding="utf-8")
    n = sum(p.numel() for p in imported.model.parameters())
    print(f"imported {imported.family} ({imported.config.arch}, {n / 1e6:.2f}M parameters) -> {out}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from ..parallel.checkpoint import consolidate_checkpoint  # noqa: PLC0415
    from ..train.checkpoint import resolve_checkpoint  # noqa: PLC0415
    from ..train.load import read_config  # noqa: PLC0415

    for flag in ("out", "tokenizer", "base", "max_shard_size"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')}: not with --consolidate, which writes into the checkpoint itself")
    checkpoint = resolve_checkpoint(args.consolidate, prefer="latest")
    file = consolidate_checkpoint(checkpoint, read_config(checkpoint))
    print(f"wrote the consolidated weights -> {file}")
    return 0


def _to_peft(args: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415

    from ..interop.convert import check_target  # noqa: PLC0415
    from ..interop.peft import to_peft  # noqa: PLC0415

    if args.tokenizer:
        raise UsageError("--tokenizer: only with --from-hf or --from-peft; an adapter has no tokenizer")
    check_target(Path(args.out), Path(args.to_peft), overwrite=args.overwrite, flag="--out")
    out = to_peft(Path(args.to_peft), args.out, base_model_name_or_path=args.base, overwrite=args.overwrite)
    print(f"wrote a PEFT LoRA adapter -> {out}")
    return 0


def _merged_peft(adapter: str, imported):
    """``imported`` with the PEFT adapter merged into its weights (notes on the rank printed)."""
    from ..interop.peft import from_peft  # noqa: PLC0415
    from ..nn.lora import unload_lora  # noqa: PLC0415

    adapted = from_peft(adapter, imported)
    for note in adapted.notes:
        print(f"note: {note}")
    unload_lora(adapted.model)
    print(f"merged the PEFT adapter {adapter} into the weights")
    return adapted
