"""``blockformer train [CONFIG.toml] [--preset NAME] [--set section.key=value ...] [--resume DIR | --init-from CKPT] [--resume-if-exists]``"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ..errors import UsageError
from ..run_config import RunConfig, load_run_config, parse_override, preset_names
from ..train.checkpoint import resolve_checkpoint
from ..train.load import read_config
from ..train.metrics import PLOT
from ..train.tracking import append_tracker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train a model. The run config has three sections, [model], [data] and [train]; it is built "
        "from the defaults, then --preset, then CONFIG.toml, then each --set. Output goes to "
        "runs/<train.name>: checkpoints (step-NNNNNN/, best/), metrics.jsonl and loss.png."
    )
    parser.epilog = ("exit codes: 0 finished; 2 bad input or a file-system error; 3 the loss, gradients, "
                     "weights or validation loss became NaN or infinite (no checkpoint holds them); "
                     "4 a parallel run waited parallel.timeout for a rank (in a collective, or for it to join) "
                     "or lost one; the ranks that stopped answering are named; "
                     "130 / 143 stopped by SIGINT / SIGTERM after saving a checkpoint")
    parser.add_argument("config", nargs="?", metavar="CONFIG.toml", help="a TOML run config")
    parser.add_argument("--preset", metavar="NAME", help="a shipped config: " + ", ".join(preset_names()))
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one value, e.g. --set model.n_layers=6 --set train.lr=1e-3 (repeatable)",
    )
    parser.add_argument(
        "--resume", metavar="DIR", help="continue from a checkpoint, or from a run directory's latest one"
    )
    parser.add_argument(
        "--resume-if-exists", action="store_true",
        help="continue the run in --out (or runs/<train.name>) from its latest checkpoint if it has one, else "
             "start it (train.resume=auto: what torchrun --max-restarts reruns; the config must be the run's)",
    )
    parser.add_argument(
        "--init-from", metavar="CKPT",
        help="fine-tune: start from this checkpoint's weights; its [model] and tokenizer are used "
             "(--set model.KEY still applies), a task head is new where the task differs",
    )
    parser.add_argument("--out", metavar="DIR", help="run directory (default: runs/<train.name>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="a fresh run into a directory holding an earlier run: replace that run "
                             "(without this, such a run is refused)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config (TOML), exit")


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The run config of ``args``: from the checkpoint when resuming (``--set`` still applies);
    with ``--init-from``, the base checkpoint's [model] with ``--set model.*`` laid over it."""
    init_from = getattr(args, "init_from", None)
    if getattr(args, "resume_if_exists", False):
        if args.resume is not None:
            raise UsageError("--resume-if-exists: resumes the run directory of this config when it has a checkpoint; "
                             "--resume DIR always resumes DIR: expected one of them")
        args = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, "train.resume=auto"]})
    if args.resume is None and init_from:
        data = load_run_config(args.config, args.preset, args.overrides).to_dict()
        data["model"] = read_config(resolve_checkpoint(init_from)).model.to_dict()
        data["train"]["init_from"] = init_from
        for item in args.overrides:
            section, key, value = parse_override(item)
            if section == "model":
                data["model"][key] = value
        return RunConfig.from_dict(data)
    if args.resume is None:
        return load_run_config(args.config, args.preset, args.overrides)
    if init_from:
        raise UsageError("--init-from: starts a new run; --resume continues one (its init-from is in its config)")
    if args.config or args.preset:
        raise UsageError("--resume: the run config comes from the checkpoint; change it with --set only")
    data = read_config(resolve_checkpoint(args.resume, prefer="latest")).to_dict()
    data["parallel"] = {}  # how the run was launched is not the run: this launch's --set decides
    for item in args.overrides:
        section, key, value = parse_override(item)
        data[section][key] = value
    return RunConfig.from_dict(data)


def run(args: argparse.Namespace) -> int:
    from ..train.loop import train  # noqa: PLC0415 - keeps `--help` fast

    cfg = resolve_config(args)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    if args.out:
        run_dir = Path(args.out)
    elif args.resume:
        run_dir = resolve_checkpoint(args.resume, prefer="latest").parent
    else:
        run_dir = Path("runs") / cfg.train.name
    if args.overwrite and args.resume:
        raise UsageError("--overwrite: replaces an earlier run for a fresh one; not with --resume")
    result = train(cfg, run_dir, resume=args.resume, overwrite=args.overwrite)
    if result.main:  # one report from a parallel run: rank 0's
        report(result, cfg)
    return 128 + result.signal if result.signal else 0  # 130 after SIGINT, 143 after SIGTERM


def report(result, cfg: RunConfig) -> None:
    """What a person wants after training: the figures, some outputs, where things are, what next."""
    from ..train.load import load_checkpoint  # noqa: PLC0415

    run_dir = result.run_dir
    if result.interrupted:
        print(f"\nstopped at step {result.step}/{cfg.train.steps}; checkpoint saved: {result.checkpoint}")
        print(f"continue with:  blockformer train --resume {shlex.quote(str(run_dir))}")
        return
    ckpt_dir = result.best or result.checkpoint
    print()
    if result.val:
        print("validation: " + "  ".join(f"{k} {v:.4f}" for k, v in result.val.items()))
    if cfg.data.kind == "dataset":  # images or signals
        q = shlex.quote(str(ckpt_dir))
        print(f"\ncheckpoint: {ckpt_dir}\nmetrics:    {run_dir / 'metrics.jsonl'}")
        if cfg.model.input == "patches":
            print("images:     predict also reads PNG files: --input FILE.png ... or a directory of them")
        print("\nnext:")
        print(f"  blockformer predict --checkpoint {q} --split test")
        if cfg.model.input == "patches":
            print(f"  blockformer probe attention --checkpoint {q} --image 0 --plot attention.png")
        print(f"  blockformer eval --checkpoint {q} --json")
        return
    ckpt = load_checkpoint(ckpt_dir)
    if cfg.head.task != "none" or cfg.model.arch == "encoder":
        q = shlex.quote(str(ckpt_dir))
        print(f"\ncheckpoint: {ckpt_dir}\nmetrics:    {run_dir / 'metrics.jsonl'}\n\nnext:")
        if cfg.head.task != "none":
            texts = cfg.data.val_labels or cfg.data.labels  # a labelled file predicts as it is
            print(f"  blockformer predict --checkpoint {q} --input {shlex.quote(texts)}")
        else:
            print(f"  blockformer train --init-from {q} --set data.labels=FILE --set head.task=classify")
        print(f"  blockformer eval --checkpoint {q}{_eval_data(cfg)} --json")
        return
    if cfg.model.arch == "decoder" and cfg.train.samples > 0:
        print(f"\nsamples ({cfg.train.sample_tokens} tokens, temperature 0.8, top-k 50):")
        for text in _reported_samples(ckpt, cfg, result):
            print("-" * 60 + "\n" + text)
        print("-" * 60)
    elif cfg.data.kind == "task":
        from ..train.setup import make_task_for  # noqa: PLC0415
        from ..train.objective import translate_greedy  # noqa: PLC0415

        pairs = make_task_for(cfg.data).heldout(5)
        outputs = translate_greedy(ckpt.model, ckpt.tokenizer, [s for s, _ in pairs])
        print("\nheld-out examples (source -> output [reference]):")
        for (src, ref), out in zip(pairs, outputs):
            print(f"  {src} -> {out}  [{ref}] {'ok' if out == ref else 'WRONG'}")
    q = shlex.quote(str(ckpt_dir))
    print(f"\ncheckpoint: {ckpt_dir}")
    print(f"loss curve: {run_dir / PLOT}")
    print(f"metrics:    {run_dir / 'metrics.jsonl'}")
    print("\nnext:")
    if cfg.model.arch == "decoder":
        prompt = next((p for p in cfg.train.sample_prompts if p.strip()), "The ")
        print(f"  blockformer generate --checkpoint {q} --prompt {shlex.quote(prompt)} --max-new-tokens 300")
    else:
        print(f"  blockformer translate --checkpoint {q}   (reads sources from stdin)")
    print(f"  blockformer eval --checkpoint {q}{_eval_data(cfg)}")
    print(f"  blockformer info --checkpoint {q}")
    print(f"  blockformer train --resume {shlex.quote(str(run_dir))} --set train.steps={2 * cfg.train.steps}")


def _reported_samples(ckpt, cfg: RunConfig, result) -> list[str]:
    """``lm_samples``, also into the run's TensorBoard events (``train.report_to``), or the
    reason there are none: the run is saved, and a sample must never fail it."""
    try:
        from ..train.samples import lm_samples  # noqa: PLC0415

        texts = lm_samples(ckpt.model, ckpt.tokenizer, cfg)
    except (UsageError, ValueError) as e:
        return [f"(no samples: {e})"]
    if result.sampled_step != result.step:  # the last evaluation logged these already
        with append_tracker(result.run_dir, cfg.train.report_to) as tracker:  # TensorBoard's Text tab
            for i, text in enumerate(texts):
                tracker.text(f"samples/{i}", text, result.step)
    return texts


def _eval_data(cfg: RunConfig) -> str:
    """The ``--data`` that ``eval`` needs to score this run's held-out text (it reads no
    file on a checkpoint's word)."""
    d = cfg.data
    if d.kind == "text":
        return "" if d.text.strip() == "stdlib" else f" --data {shlex.quote(d.text)}"
    if d.kind == "pairs":
        return f" --data {shlex.quote((d.val_src or d.src) + ',' + (d.val_tgt or d.tgt))}"
    if d.kind == "labelled":
        return f" --data {shlex.quote(d.val_labels or d.labels)}"
    return ""


