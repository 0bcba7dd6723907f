"""Multi30k German->English: train the ``translate-small`` preset within a time budget,
then report validation BLEU and chrF (detokenised, cased sacreBLEU) and decoding speed.

    OMP_NUM_THREADS=2 python benchmarks/bench_translate.py --threads 2 --max-minutes 30
    python benchmarks/bench_translate.py --checkpoint runs/bench-translate   # score a trained run
    python benchmarks/bench_translate.py --max-minutes 1 --set train.steps=20 --set train.eval_every=5 \\
        --limit 50                                                            # smoke

Target (issue 4): BLEU >= 35 on val with at most 30 minutes of training on a 2-core CPU
(published small Transformers: ~30-36), beam 4 above greedy. Rows: the last checkpoint and
the averages of the last N checkpoints for each N in ``--average`` (Vaswani et al. 2017
average the last 5), each decoded greedily and with beam search; sentences/s is measured
on the whole validation set. The time limit is the trainer's ``train.max_minutes`` (it saves
a checkpoint and returns when the budget is spent); the noam schedule does not depend on
the total step count, so a run cut by time is the same run as one planned that long.
Figures go to ``--out`` (.json and .md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from blockformer.cli.translate import read_lines, translate_texts
from blockformer.generate.scoring import translation_scores
from blockformer.run_config import load_run_config
from blockformer.train import load_checkpoint, train
from blockformer.train.average import average_checkpoints
from blockformer.train.checkpoint import resolve_checkpoint, step_checkpoints
from blockformer.precision import autocast

from common import cpu_kind

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "multi30k"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA, help="directory with {train,val}.{de,en}.gz")
    p.add_argument("--preset", default="translate-small")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--max-minutes", type=float, default=30.0, help="training time budget (default 30)")
    p.add_argument("--checkpoint", type=Path, help="skip training: score this run (or checkpoint) directory")
    p.add_argument("--run-dir", type=Path, default=REPO / "runs" / "bench-translate")
    p.add_argument("--average", default="2,5", help="average the last N step checkpoints, for each N listed ('' = off)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--batch-size", type=int, default=64, help="sentences per decoding batch")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="decoding precision")
    p.add_argument("--limit", type=int, default=None, help="score only the first N validation sentences")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "translate")
    return p.parse_args()


def train_with_budget(args: argparse.Namespace) -> tuple[Path, float, dict]:
    """Train the preset on ``args.data`` for at most ``--max-minutes`` (``train.max_minutes``)."""
    d = args.data
    overrides = [f"data.src={d / 'train.de.gz'}", f"data.tgt={d / 'train.en.gz'}",
                 f"data.val_src={d / 'val.de.gz'}", f"data.val_tgt={d / 'val.en.gz'}",
                 f"train.max_minutes={args.max_minutes}", *args.overrides]
    cfg = load_run_config(preset=args.preset, overrides=overrides)
    t0 = time.perf_counter()
    result = train(cfg, args.run_dir)
    minutes = (time.perf_counter() - t0) / 60
    info = {"steps": result.step, "planned_steps": cfg.train.steps, "stopped_by_time": result.interrupted,
            "val_loss": result.val.get("val_loss"), "config": cfg.to_dict()}
    return args.run_dir, minutes, info


def score(path: Path, sources: list[str], refs: list[str], args: argparse.Namespace) -> list[dict]:
    """Greedy and beam rows for one checkpoint: BLEU, chrF, sentences/s."""
    ckpt = load_checkpoint(path)
    rows = []
    for beam in (1, args.beam):
        t0 = time.perf_counter()
        with autocast(args.precision, torch.device("cpu")):
            hyps = translate_texts(ckpt.model, ckpt.tokenizer, sources, beam_size=beam, alpha=args.alpha,
                                   batch_size=args.batch_size)
        seconds = time.perf_counter() - t0
        s = translation_scores(hyps, refs)
        rows.append({"checkpoint": str(path), "search": "greedy" if beam == 1 else f"beam {beam}",
                     "alpha": args.alpha if beam > 1 else None, "bleu": s["bleu"].score, "chrf": s["chrf"].score,
                     "bleu_signature": s["bleu"].signature, "chrf_signature": s["chrf"].signature,
                     "bleu_summary": s["bleu"].summary, "sentences_per_s": len(sources) / seconds,
                     "examples": list(zip(sources[:3], hyps[:3], refs[:3]))})
        print(f"{path.name:>14} {rows[-1]['search']:>7}: BLEU {s['bleu'].score:.2f}  chrF {s['chrf'].score:.2f}  "
              f"{rows[-1]['sentences_per_s']:.1f} sent/s", flush=True)
    return rows


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.checkpoint is None and not (args.data / "train.de.gz").is_file():
        print(f"Multi30k not found in {args.data}; expected train.de.gz etc. (see ../shared/data)", file=sys.stderr)
        return 2
    minutes, info = None, {}
    if args.checkpoint is None:
        run_dir, minutes, info = train_with_budget(args)
    else:
        run_dir = args.checkpoint
    sources, refs = read_lines(str(args.data / "val.de.gz")), read_lines(str(args.data / "val.en.gz"))
    if args.limit:
        sources, refs = sources[: args.limit], refs[: args.limit]
    candidates = step_checkpoints(run_dir)
    last = candidates[-1] if candidates else resolve_checkpoint(run_dir, prefer="latest")
    rows = score(last, sources, refs, args)
    info["averaged"] = {}
    for n in sorted({min(int(n), len(candidates)) for n in args.average.split(",") if n.strip()}):
        if n >= 2:
            chosen = candidates[-n:]
            rows += score(average_checkpoints(chosen, run_dir / f"avg{n}"), sources, refs, args)
            info["averaged"][f"avg{n}"] = [p.name for p in chosen]
    report = {"benchmark": "multi30k de-en", "threads": torch.get_num_threads(), "cpu_kind": cpu_kind(),
              "train_minutes": minutes, "val_sentences": len(sources), "decode_precision": args.precision,
              "command": " ".join(sys.argv), **info, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    trained = f"{minutes:.1f} min of training, {info['steps']} steps" if minutes is not None else "given checkpoint"
    md = [f"Multi30k de->en, val ({len(sources)} sentences), detokenised cased sacreBLEU; {trained}; "
          f"{report['threads']} threads, CPU {report['cpu_kind']} (`{report['command']}`)", "",
          "| checkpoint | search | BLEU | chrF2 | sentences/s |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {Path(r['checkpoint']).name} | {r['search']} | {r['bleu']:.2f} | {r['chrf']:.2f} | "
                  f"{r['sentences_per_s']:.1f} |")
    md += ["", f"BLEU signature: `{rows[0]['bleu_signature']}`; chrF: `{rows[0]['chrf_signature']}`"]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
