"""Pre-train, then fine-tune, on a real task: which standard-library package a function is from.

    python benchmarks/bench_finetune.py                       # the BENCHMARKS.md run (~15 min, 2 cores)
    python benchmarks/bench_finetune.py --mlm-steps 20 --ft-steps 20   # smoke

In one run: the data (``blockformer.data.stdlib_packages``: the 10 packages with the most
functions, a fixed fifth of the functions held out); a scikit-learn TF-IDF + logistic
regression baseline; the ``stdlib-packages`` encoder trained from scratch on the labels
alone; the ``stdlib-mlm`` encoder pre-trained by masked-LM on the rest of the standard
library (the held-out functions cut out), then fine-tuned fully and with LoRA. Each is
scored on every held-out function (accuracy, macro F1) at its last step; figures go to
``--out`` as JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from blockformer.data import stdlib_packages
from blockformer.data.labelled import read_labelled
from blockformer.run_config import load_run_config
from blockformer.stats import count_parameters
from blockformer.train import load_checkpoint, train
from blockformer.train.finetune import build_model_for
from blockformer.train.load import read_config
from blockformer.train.setup import build_head_objective

from common import cpu_kind

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-finetune", help="data and runs go here")
    p.add_argument("--mlm-steps", type=int, default=None, help="override stdlib-mlm's train.steps")
    p.add_argument("--ft-steps", type=int, default=None, help="override stdlib-packages' train.steps")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "finetune")
    return p.parse_args()


def baseline(train_ex: list, val_ex: list, prefix: int | None) -> dict:
    """TF-IDF over identifiers (unigrams and bigrams) + logistic regression, on the whole
    function or its first ``prefix`` bytes (what the encoders read)."""
    from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.metrics import accuracy_score, f1_score  # noqa: PLC0415

    cut = (lambda t: t.encode()[:prefix].decode("utf-8", "ignore")) if prefix else (lambda t: t)  # noqa: E731
    t0 = time.perf_counter()
    vec = TfidfVectorizer(token_pattern=r"[A-Za-z_][A-Za-z0-9_]*", ngram_range=(1, 2), sublinear_tf=True, min_df=2)
    x_train = vec.fit_transform([cut(t) for t, _ in train_ex])
    clf = LogisticRegression(C=10.0, max_iter=3000).fit(x_train, [y for _, y in train_ex])
    pred = clf.predict(vec.transform([cut(t) for t, _ in val_ex]))
    true = [y for _, y in val_ex]
    return {"accuracy": accuracy_score(true, pred), "macro_f1": f1_score(true, pred, average="macro"),
            "trainable_params": int(clf.coef_.size + clf.intercept_.size), "minutes": (time.perf_counter() - t0) / 60}


def finetune(name: str, overrides: list[str], work: Path, init_from: Path | None = None) -> dict:
    """Train the stdlib-packages preset (from ``init_from`` if given), score its last checkpoint."""
    cfg = load_run_config(preset="stdlib-packages", overrides=overrides)
    if init_from is not None:  # as `train --init-from`: the base's [model]
        cfg = dataclasses.replace(cfg, model=read_config(init_from).model,
                                  train=dataclasses.replace(cfg.train, init_from=str(init_from)))
    t0 = time.perf_counter()
    result = train(cfg, work / name)
    minutes = (time.perf_counter() - t0) / 60
    ckpt = load_checkpoint(result.checkpoint)
    objective = build_head_objective(ckpt.config, ckpt.tokenizer, torch.device("cpu"), log=lambda *a: None)
    metrics = objective.evaluate_full(ckpt.model, 64)
    trained = build_model_for(ckpt.config, load_init=False, log=None)  # as it trained: adapters, frozen parts
    return {"accuracy": metrics["accuracy"], "macro_f1": metrics["macro_f1"], "val_loss": metrics["val_loss"],
            "trainable_params": count_parameters(trained, trainable_only=True),
            "total_params": count_parameters(trained), "minutes": minutes, "steps": cfg.train.steps,
            "confusion_matrix": metrics["confusion_matrix"], "labels": metrics["labels"]}


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = args.work / "data"
    counts = stdlib_packages.write(data)
    print(f"data: {counts}", flush=True)
    train_ex, val_ex = read_labelled(data / "train.jsonl"), read_labelled(data / "val.jsonl")
    # fp32, as measured for BENCHMARKS.md (the presets' "auto" picks bf16 on CPUs with bf16 units)
    paths = [f"data.labels={data / 'train.jsonl'}", f"data.val_labels={data / 'val.jsonl'}", "train.progress=false",
             "train.precision=fp32"]
    ft = paths + ([f"train.steps={args.ft_steps}", f"train.eval_every={args.ft_steps}"] if args.ft_steps else [])
    rows = {}
    rows["TF-IDF + logistic regression (whole function)"] = baseline(train_ex, val_ex, None)
    rows["TF-IDF + logistic regression (first 126 bytes)"] = baseline(train_ex, val_ex, 126)
    print(json.dumps(rows, indent=1), flush=True)

    rows["encoder from scratch"] = finetune("scratch", ft, args.work)
    mlm_over = [f"data.text={data / 'pretrain.txt'}", "train.progress=false", "train.precision=fp32"]
    if args.mlm_steps:
        mlm_over += [f"train.steps={args.mlm_steps}", f"train.eval_every={args.mlm_steps}"]
    t0 = time.perf_counter()
    mlm = train(load_run_config(preset="stdlib-mlm", overrides=mlm_over), args.work / "mlm")
    mlm_minutes = (time.perf_counter() - t0) / 60
    base = mlm.checkpoint
    rows["pre-trained + full fine-tune"] = finetune("full", ft, args.work, base)
    lora = [*ft, f"lora.rank={args.lora_rank}", f"lora.alpha={2 * args.lora_rank}", "lora.targets=qkv,out,up,down",
            f"train.lr={args.lora_lr}"]
    rows["pre-trained + LoRA"] = finetune("lora", lora, args.work, base)
    result = {"data": counts, "mlm": {"minutes": mlm_minutes, **mlm.val, "steps": mlm.step},
              "lora_rank": args.lora_rank, "cpu_kind": cpu_kind(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = [f"CPU {result['cpu_kind']}, {torch.get_num_threads()} threads", "",
             "| model | accuracy | macro F1 | trainable parameters | minutes |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        table.append(f"| {name} | {r['accuracy']:.3f} | {r['macro_f1']:.3f} | {r['trainable_params']:,} | "
                     f"{r['minutes']:.1f} |")
    text = "\n".join(table) + (f"\n\nMLM pre-training: {mlm.step} steps, {mlm_minutes:.1f} min, held-out masked-token "
                               f"accuracy {mlm.val.get('masked_accuracy', float('nan')):.3f}, loss {mlm.val['val_loss']:.3f}\n")
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
