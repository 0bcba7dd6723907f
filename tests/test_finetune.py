"""Fine-tuning from a checkpoint: what is carried over and what is named, frozen weights that
stay bit-identical, layer-wise and head learning rates, and the --init-from command line."""

import random

import pytest
import torch

from blockformer.cli import main
from blockformer.models import build_model
from blockformer.models.heads import TaskModel
from blockformer.run_config import load_run_config
from blockformer.tokenizers import train_tokenizer
from blockformer.train import train
from blockformer.train.checkpoint import save_checkpoint
from blockformer.train.finetune import build_model_for, lr_scale
from blockformer.train.load import load_checkpoint
from blockformer.train.optim import build_optimizer

QUIET = dict(log=lambda *a: None)
MODEL = ["model.arch=encoder", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=48",
         "model.vocab_size=260"]


def _labelled(path, labels, n=120, seed=0):
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label = r.choice(labels)
            f.write(f"{label} {r.choice('xyz')} {label}\t{label}\n")
    return path


def _run_cfg(tmp_path, base, labels=("a", "b"), *overrides):
    data = [f"data.labels={_labelled(tmp_path / ('d-' + ''.join(labels) + '.tsv'), list(labels))}", "data.seq_len=48"]
    train_ = ["train.steps=6", "train.eval_every=0", "train.batch_size=8", "train.progress=false", "train.lr=1e-2",
              "train.warmup=0"]
    return load_run_config(overrides=[*MODEL, *data, *train_, "head.task=classify", f"train.init_from={base}",
                                      *overrides])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An encoder checkpoint (random weights: only their identity matters here)."""
    tmp = tmp_path_factory.mktemp("base")
    cfg = load_run_config(overrides=MODEL)
    return save_checkpoint(tmp / "mlm", build_model(cfg.model, seed=3), train_tokenizer("byte", []), cfg)


def test_init_from_a_body_names_the_new_head(base, tmp_path):
    lines = []
    cfg = _run_cfg(tmp_path, base)
    cfg.head.labels = ["a", "b"]
    model = build_model_for(cfg, log=lines.append)
    assert "new (not in the base): head.proj.weight, head.proj.bias" in lines[0]
    assert "unused" not in lines[0]  # the encoder's tied MLM head is part of the body
    base_state = load_checkpoint(base).model.state_dict()
    assert all(torch.equal(v, base_state[k[len("body."):]]) for k, v in model.state_dict().items()
               if k.startswith("body."))


def test_init_from_with_a_changed_head_names_the_skipped_tensors(base, tmp_path):
    """A classifier for labels a, b, c started from one for a, b: the body is carried over,
    the head is not, and the log line says which tensors were skipped."""
    first = train(_run_cfg(tmp_path, base, ("a", "b")), tmp_path / "ab", **QUIET)
    lines = []
    result = train(_run_cfg(tmp_path, first.checkpoint, ("a", "b", "c")), tmp_path / "abc", log=lines.append)
    report = next(line for line in lines if line.startswith("init-from"))
    assert "skipped (shape or task differs): head.proj.weight (2, 32)->(3, 32), head.proj.bias (2,)->(3,)" in report
    # the same task again carries the head over too
    lines.clear()
    train(_run_cfg(tmp_path, first.checkpoint, ("a", "b")), tmp_path / "ab2", log=lines.append)
    report = next(line for line in lines if line.startswith("init-from"))
    assert "skipped" not in report and "new" not in report
    assert result.step == 6


@pytest.mark.parametrize("freeze,frozen_prefix", [("body", "body."), ("embeddings", "body.embed.")])
def test_frozen_weights_are_bit_identical_after_training(base, tmp_path, freeze, frozen_prefix):
    result = train(_run_cfg(tmp_path, base, ("a", "b"), f"train.freeze={freeze}"), tmp_path / "run", **QUIET)
    trained = load_checkpoint(result.checkpoint).model.state_dict()
    start = {"body." + k: v for k, v in load_checkpoint(base).model.state_dict().items()}
    frozen = [k for k in trained if k.startswith(frozen_prefix) or k == "body.head.weight"]  # tied to the embedding
    assert frozen and all(torch.equal(trained[k], start[k]) for k in frozen)
    moved = [k for k in trained if k not in frozen and k in start and not torch.equal(trained[k], start[k])]
    assert bool(moved) == (freeze == "embeddings")  # the blocks train unless the body is frozen


def test_layer_wise_decay_and_a_separate_head_rate_set_each_groups_lr(base, tmp_path):
    cfg = _run_cfg(tmp_path, base, ("a", "b"), "train.layer_lr_decay=0.5", "train.head_lr=4e-2", "train.lr=1e-2")
    cfg.head.labels = ["a", "b"]
    model = build_model_for(cfg, log=None)
    scale = lr_scale(model, cfg)
    assert scale("body.embed.tokens.weight") == 0.5**3
    assert scale("body.encoder.blocks.0.attn.qkv.weight") == 0.5**2
    assert scale("body.encoder.blocks.1.ffn.up.weight") == 0.5
    assert scale("body.encoder.final_norm.weight") == 1.0
    assert scale("head.proj.weight") == 4.0
    optimizer = build_optimizer(model, cfg.train, scale)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert lr_of[id(model.head.proj.weight)] == pytest.approx(4e-2)
    assert lr_of[id(model.body.embed.tokens.weight)] == pytest.approx(1e-2 / 8)
    assert lr_of[id(model.body.encoder.blocks[0].attn.qkv.weight)] == pytest.approx(1e-2 / 4)


def test_init_from_on_the_command_line_takes_the_base_model_and_tokenizer(base, tmp_path, capsys):
    data = _labelled(tmp_path / "d.tsv", ["a", "b"])
    args = ["train", "--init-from", str(base), "--set", f"data.labels={data}", "--set", "head.task=classify",
            "--set", "model.dropout=0.1", "--print-config"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "d_model = 32" in out and "n_layers = 2" in out and "dropout = 0.1" in out
    assert f'init_from = "{base}"' in out
    assert main(["train", "--init-from", str(base), "--resume", str(base)]) == 2
    assert "--init-from" in capsys.readouterr().err


def test_a_lora_classifier_resumes_and_predicts(base, tmp_path, capsys):
    cfg = _run_cfg(tmp_path, base, ("a", "b"), "lora.rank=2", "train.steps=8", "train.eval_every=4")
    stopped = train(cfg, tmp_path / "run", stop_at=4, **QUIET)
    assert stopped.interrupted
    resumed = train(cfg, tmp_path / "run", resume=tmp_path / "run", **QUIET)
    straight = train(cfg, tmp_path / "straight", **QUIET)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses[4:]), atol=1e-5, rtol=0)
    model = load_checkpoint(resumed.checkpoint).model
    assert isinstance(model, TaskModel)
    (tmp_path / "in.txt").write_text("a x a\n")
    assert main(["predict", "--checkpoint", str(resumed.checkpoint), "--input", str(tmp_path / "in.txt")]) == 0
    assert '"label"' in capsys.readouterr().out
