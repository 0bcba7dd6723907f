"""Other inputs: the digits ViT, JapaneseVowels frames and digit strings, with baselines in the same run.

    python benchmarks/bench_inputs.py                                  # everything, seeds 0-2
    python benchmarks/bench_inputs.py --steps 50 --seeds 0 --parts digits   # smoke
    python benchmarks/bench_inputs.py --parts digits --set data.rotate=0    # an ablation

- ``digits``: the ``digits-vit`` preset, test accuracy on the fixed 360-image test split
  (mean and spread of the seeds) of the checkpoint the run keeps (what ``blockformer
  predict --checkpoint RUN`` reads: the preset evaluates only at the end, so the last),
  against scikit-learn's ``SVC()`` (RBF kernel) and ``LogisticRegression(max_iter=5000)``
  with default hyperparameters on the same 1,293 training images, and the baseline people
  would use: an SVC with C and gamma chosen by accuracy on the 144 validation images, fitted
  on the training images alone and refitted on training + validation. The test split is
  read once, at the end.
- ``vowels``: the ``vowels-frames`` preset, test accuracy on the archive's 370 test
  utterances, against 1-nearest-neighbour with dynamic time warping (the standard baseline
  of the UEA archive, Bagnall et al.; full window, squared Euclidean frame distance,
  "DTW_D") on the same 243 standardised training utterances.
- ``strings``: the ``digits-to-text`` preset (patches in, digits out, through the KV cache),
  exact match on 500 test strings of 1-4 digits, greedy and beam 4, against the SVC
  applied to each 8-pixel slot (it is told where the digits are; the model is not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from blockformer.run_config import load_run_config
from blockformer.train import load_checkpoint, train

from common import cpu_kind

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="digits,vowels,strings")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None, help="override every preset's train.steps")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every preset trained (repeatable), e.g. train.lr=1e-3")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "inputs")
    return p.parse_args()


def train_preset(preset: str, seed: int, args: argparse.Namespace, work: Path) -> tuple[object, dict]:
    """Train ``preset`` with ``seed``; the checkpoint the run keeps (``resolve_checkpoint``, as
    ``predict`` reads it) and what is known of the run. ``--steps`` scales the preset's
    evaluation interval with it (a preset that evaluates only at the end still does)."""
    from blockformer.train.checkpoint import resolve_checkpoint

    overrides = [f"train.seed={seed}", "train.progress=false", "train.precision=fp32"]  # as measured
    if args.steps is not None:
        tc = load_run_config(preset=preset).train
        every = tc.eval_every and max(1, args.steps * tc.eval_every // tc.steps)
        overrides += [f"train.steps={args.steps}", f"train.eval_every={every}"]
    overrides += args.set
    cfg = load_run_config(preset=preset, overrides=overrides)
    t0 = time.perf_counter()
    result = train(cfg, work / f"{preset}-{seed}", log=lambda *a: None)
    kept = resolve_checkpoint(result.run_dir)
    ckpt = load_checkpoint(kept)
    return ckpt, {"seed": seed, "steps": cfg.train.steps, "val": result.val, "train_s": time.perf_counter() - t0,
                  "checkpoint_step": int(kept.resolve().name.split("-")[-1])}


@torch.no_grad()
def head_accuracy(ckpt, split: str) -> float:
    from blockformer.data.arrays import array_data

    data = array_data(ckpt.config, split)
    right = 0
    for batch in data.batches(256):
        right += int((ckpt.model(batch.tokens, attention_mask=batch.mask).argmax(-1) == batch.targets).sum())
    return right / len(data)


def summary(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "values": values}


def seed_runs(preset: str, seeds, args, work) -> list[dict]:
    """``preset`` trained once per seed, each scored on its test split."""
    runs = []
    for seed in seeds:
        ckpt, info = train_preset(preset, seed, args, work)
        info["test_accuracy"] = head_accuracy(ckpt, "test")
        runs.append(info)
        print(json.dumps({preset: info}), flush=True)
    return runs


def digits(args, seeds, work) -> dict:
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import SVC

    from blockformer.data.images import load_digits_split

    runs = seed_runs("digits-vit", seeds, args, work)
    (xtr, ytr), (xva, yva), (xte, yte) = (load_digits_split(s) for s in ("train", "val", "test"))
    xtr, xva, xte = (x.flatten(1).numpy() for x in (xtr, xva, xte))
    ytr, yva, yte = ytr.numpy(), yva.numpy(), yte.numpy()
    baselines = {}
    for name, model in (("SVC (RBF, defaults)", SVC()), ("logistic regression", LogisticRegression(max_iter=5000))):
        t0 = time.perf_counter()
        model.fit(xtr, ytr)
        baselines[name] = {"test_accuracy": float((model.predict(xte) == yte).mean()),
                           "fit_s": time.perf_counter() - t0}
    C, gamma, val_acc = tune_svc(xtr, ytr, xva, yva)
    for name, (x, y) in ((f"SVC (RBF, C={C:g}, gamma={gamma}, tuned on val), fitted on train", (xtr, ytr)),
                         (f"SVC (RBF, C={C:g}, gamma={gamma}, tuned on val), refitted on train+val",
                          (np.concatenate([xtr, xva]), np.concatenate([ytr, yva])))):
        model = SVC(C=C, gamma=gamma).fit(x, y)
        baselines[name] = {"test_accuracy": float((model.predict(xte) == yte).mean()), "C": C, "gamma": gamma,
                           "val_accuracy": val_acc}
    return {"vit": runs, "vit_test_accuracy": summary([r["test_accuracy"] for r in runs]), "baselines": baselines,
            "train_images": len(ytr), "val_images": len(yva), "test_images": len(yte)}


def tune_svc(xtr, ytr, xva, yva) -> tuple[float, object, float]:
    """(C, gamma, validation accuracy) of the RBF SVC most accurate on the validation images;
    ties (one image is 0.7 points of 144) go to the smaller C, then the earlier gamma."""
    from sklearn.svm import SVC

    grid = [(C, g) for C in (0.3, 1, 3, 10, 30, 100) for g in ("scale", 0.01, 0.03, 0.1, 0.3)]
    scored = [(float((SVC(C=C, gamma=g).fit(xtr, ytr).predict(xva) == yva).mean()), -i, C, g)
              for i, (C, g) in enumerate(grid)]
    acc, _, C, g = max(scored)
    return C, g, acc


def dtw_distances(query: np.ndarray, refs: list[np.ndarray]) -> np.ndarray:
    """DTW (squared Euclidean frame cost, full window) from ``query`` (T, F) to every reference,
    vectorised over the references (padded; each reads its own end cell)."""
    L = max(len(r) for r in refs)
    R = np.zeros((len(refs), L, query.shape[1]))
    lengths = np.array([len(r) for r in refs])
    for i, r in enumerate(refs):
        R[i, : len(r)] = r
    cost = ((query[None, :, None, :] - R[:, None, :, :]) ** 2).sum(-1)  # (N, Tq, L)
    D = np.full((len(refs), len(query) + 1, L + 1), np.inf)
    D[:, 0, 0] = 0.0
    for i in range(1, len(query) + 1):
        for j in range(1, L + 1):
            D[:, i, j] = cost[:, i - 1, j - 1] + np.minimum(np.minimum(D[:, i - 1, j], D[:, i, j - 1]), D[:, i - 1, j - 1])
    return D[np.arange(len(refs)), len(query), lengths]


def vowels(args, seeds, work) -> dict:
    from blockformer.data.frames import load_vowels_split

    runs = seed_runs("vowels-frames", seeds, args, work)
    (xtr, ytr), (xte, yte) = load_vowels_split("train"), load_vowels_split("test")
    refs = [x.numpy().astype(np.float64) for x in xtr]
    t0 = time.perf_counter()
    pred = [int(ytr[int(np.argmin(dtw_distances(q.numpy().astype(np.float64), refs)))]) for q in xte]
    dtw = {"test_accuracy": float(np.mean(np.array(pred) == yte.numpy())), "s": time.perf_counter() - t0}
    return {"transformer": runs, "transformer_test_accuracy": summary([r["test_accuracy"] for r in runs]),
            "baselines": {"1-NN DTW": dtw}, "train_series": len(ytr), "test_series": len(yte)}


def strings(args, seeds, work) -> dict:
    from sklearn.svm import SVC

    from blockformer.data.images import load_digits_split
    from blockformer.data.arrays import DigitStrings
    from blockformer.train.arrays import decode_images

    ckpt, info = train_preset("digits-to-text", seeds[0], args, work)
    cfg = ckpt.config
    test = DigitStrings("test", cfg, ckpt.tokenizer, 64, train=False)
    images, texts = test.heldout(500)
    out = {"run": info, "test_strings": len(texts)}
    for name, beam in (("greedy", 1), ("beam 4", 4)):
        pred = decode_images(ckpt.model, ckpt.tokenizer, images, cfg.model.patch_size, 128, beam)
        out[name] = sum(p == t for p, t in zip(pred, texts)) / len(texts)
    xtr, ytr = load_digits_split("train")
    svc = SVC().fit(xtr.flatten(1).numpy(), ytr.numpy())
    right = 0
    for im, t in zip(images, texts):
        slots = im[0].reshape(8, -1, 8).permute(1, 0, 2).reshape(-1, 64).numpy()  # (k, 64), left to right
        right += "".join(str(d) for d in svc.predict(slots)) == t
    out["SVC per slot (told the segmentation)"] = right / len(texts)
    print(json.dumps({"digits-to-text": out}), flush=True)
    return out


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    report = {"benchmark": "other inputs", "threads": torch.get_num_threads(), "cpu_kind": cpu_kind(),
              "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            report[part] = {"digits": digits, "vowels": vowels, "strings": strings}[part](args, seeds, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = [f"Other inputs, {report['threads']} threads, CPU {report['cpu_kind']} (`{report['command']}`)", ""]
    if "digits" in report:
        d = report["digits"]
        s = d["vit_test_accuracy"]
        md += ["| digits (8x8), test split of 360 | test accuracy |", "|---|---|",
               f"| ViT `digits-vit`, seeds {args.seeds} (mean, min-max), checkpoint kept: step "
               f"{', '.join(str(r['checkpoint_step']) for r in d['vit'])} | {s['mean']:.4f} "
               f"({s['min']:.4f}-{s['max']:.4f}; std {s['std']:.4f}) |"]
        md += [f"| {k} | {v['test_accuracy']:.4f} |" for k, v in d["baselines"].items()] + [""]
    if "vowels" in report:
        v = report["vowels"]
        s = v["transformer_test_accuracy"]
        md += ["| JapaneseVowels, 370 test utterances | test accuracy |", "|---|---|",
               f"| Transformer `vowels-frames`, seeds {args.seeds} (mean, min-max) | {s['mean']:.4f} "
               f"({s['min']:.4f}-{s['max']:.4f}; std {s['std']:.4f}) |"]
        md += [f"| {k} | {b['test_accuracy']:.4f} |" for k, b in v["baselines"].items()] + [""]
    if "strings" in report:
        st = report["strings"]
        md += [f"| digit strings (1-4 digits), {st['test_strings']} test images | exact match |", "|---|---|",
               f"| `digits-to-text`, greedy | {st['greedy']:.4f} |", f"| `digits-to-text`, beam 4 | {st['beam 4']:.4f} |",
               f"| SVC per 8-pixel slot (told the segmentation) | {st['SVC per slot (told the segmentation)']:.4f} |", ""]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
