"""Dense FFN versus mixture-of-experts with the same active parameters, on the stdlib corpus.

    python benchmarks/bench_moe.py                  # the stdlib-lm preset, 1000 steps each
    python benchmarks/bench_moe.py --steps 20       # smoke

Both models are the ``stdlib-lm`` preset (width 192, 4 layers, d_ff 768), trained on the
same tokens for the same steps with the same seed. The MoE replaces each FFN by E=8 experts
of width 384, top-2: a token uses 2 x 384 = 768 FFN units, as the dense model does, from
4x the FFN parameters. Reported: validation loss, training tokens/s, and the per-expert load
(share of assignments) of each layer over the validation windows. Figures go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from blockformer.nn.moe import moe_layers
from blockformer.run_config import load_run_config
from blockformer.stats import active_parameters, count_parameters
from blockformer.train import load_checkpoint, train
from blockformer.train.metrics import read_metrics
from blockformer.train.setup import build_objective

from common import cpu_kind

REPO = Path(__file__).resolve().parents[1]
MOE = ["model.ffn_experts=8", "model.experts_top_k=2", "model.expert_d_ff=384"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="override train.steps (default: the preset's 1000)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="applied to both models, e.g. model.expert_capacity_factor=1.25 applies to the MoE only")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "moe")
    return p.parse_args()


def run_one(name: str, overrides: list[str], args: argparse.Namespace, work: Path) -> dict:
    extra = ["train.samples=0", "train.progress=false"]
    if args.steps is not None:
        extra += [f"train.steps={args.steps}", f"train.eval_every={args.steps}"]
    cfg = load_run_config(preset="stdlib-lm", overrides=[*extra, *args.overrides, *overrides])
    t0 = time.perf_counter()
    result = train(cfg, work / name)
    wall = time.perf_counter() - t0
    records = read_metrics(work / name)
    tok_s = [r["tokens_per_s"] for r in records if r.get("split") == "train"][1:]  # the first log includes warm-up
    ckpt = load_checkpoint(result.checkpoint)
    loads = validation_load(ckpt, cfg)
    return {"model": name, "steps": result.step, "val_loss": result.val["val_loss"],
            "tokens_per_s": sum(tok_s) / max(len(tok_s), 1), "wall_s": wall, "cpu_kind": cpu_kind(),
            "parameters": count_parameters(ckpt.model),
            "active_parameters": active_parameters(ckpt.model, ckpt.config.model),
            "expert_load": loads}


@torch.no_grad()
def validation_load(ckpt, cfg) -> list[list[float]]:
    """Per layer, each expert's share of the top-k assignments over the validation windows."""
    layers = moe_layers(ckpt.model)
    if not layers:
        return []
    objective = build_objective(ckpt.config, ckpt.tokenizer, torch.device("cpu"), log=lambda *a: None)
    totals = torch.zeros(len(layers), layers[0].n_experts)
    for x, _ in objective.val.eval_batches(cfg.train.batch_size, cfg.train.eval_batches):
        ckpt.model(x)
        totals += torch.stack([m.stats["load"].float() for m in layers])
    return (totals / totals.sum(-1, keepdim=True)).tolist()


def table(rows: list[dict]) -> str:
    lines = ["| model | parameters | active | val loss | tokens/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['parameters']:,} | {r['active_parameters']:,} | "
                     f"**{r['val_loss']:.3f}** | {r['tokens_per_s']:,.0f} |")
    moe = rows[-1]
    if moe["expert_load"]:
        lines += ["", "| layer | " + " | ".join(f"e{i}" for i in range(len(moe['expert_load'][0]))) + " |",
                  "|---" * (len(moe["expert_load"][0]) + 1) + "|"]
        for i, load in enumerate(moe["expert_load"]):
            lines.append(f"| {i} | " + " | ".join(f"{v:.3f}" for v in load) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as work:
        rows = [run_one("dense", [], args, Path(work)), run_one("moe-8x2", MOE, args, Path(work))]
    text = f"CPU {rows[0]['cpu_kind']}\n\n" + table(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
