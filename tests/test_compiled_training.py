"""``train.compile``: model + loss traced once per batch shape (no recompiles after the
first steps), seq2seq batches padded to a few bucket shapes, and the same loss curve as
eager training."""

import pytest
import torch

from blockformer.data import buckets as buckets_module
from blockformer.data.batcher import TokenBatcher
from blockformer.data.buckets import bucket_of, length_buckets, pad_to_shape
from blockformer.data.seq2seq import collate_pairs
from blockformer.train import compile as compile_module
from blockformer.train import loop as loop_module
from blockformer.train import train
from blockformer.train.objective import Seq2Seq
from blockformer.nn.loss import token_loss
from blockformer import TransformerConfig, build_model

from test_train_loop import QUIET, tiny_lm, tiny_pairs, tiny_task


class CountingBackend:
    """A dynamo backend that runs the captured graph as is and counts compilations."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture
def counting(monkeypatch):
    torch._dynamo.reset()
    backend = CountingBackend()
    monkeypatch.setattr(compile_module, "BACKEND", backend)
    yield backend
    torch._dynamo.reset()


def _shapes_seen(monkeypatch) -> list:
    seen = []
    original = Seq2Seq.next_batch

    def next_batch(self):
        batch = original(self)
        seen.append((tuple(batch.src.shape), tuple(batch.tgt_in.shape)))
        return batch

    monkeypatch.setattr(Seq2Seq, "next_batch", next_batch)
    return seen


# ------------------------------------------------------------------ bucket shapes
def test_length_buckets_grow_by_about_one_and_a_half():
    assert length_buckets(128) == [16, 24, 32, 48, 64, 96, 128]
    assert length_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert length_buckets(10) == [10]
    assert [bucket_of(n, [16, 24, 32]) for n in (1, 16, 17, 25, 40)] == [16, 16, 24, 32, 32]


def test_padding_a_batch_to_its_bucket_shape_leaves_the_loss_unchanged():
    cfg = TransformerConfig(arch="encoder-decoder", vocab_size=20, d_model=32, n_layers=1, n_heads=2,
                            max_seq_len=32, dropout=0.0)
    model = build_model(cfg, seed=0).eval()
    batch = collate_pairs([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11, 12])])
    padded = pad_to_shape(batch, rows=5, length=16)
    assert padded.src.shape == padded.tgt_in.shape == (5, 16)
    assert (padded.num_tokens, padded.num_src_tokens) == (batch.num_tokens, batch.num_src_tokens)
    loss = token_loss(model(batch.src, batch.tgt_in, src_mask=batch.src_mask, tgt_mask=batch.tgt_mask), batch.tgt_out)
    loss_padded = token_loss(model(padded.src, padded.tgt_in, src_mask=padded.src_mask, tgt_mask=padded.tgt_mask), padded.tgt_out)
    torch.testing.assert_close(loss_padded, loss, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(loss_padded)


def test_bucketed_batcher_uses_one_shape_per_bucket_and_every_pair_once():
    g = torch.Generator().manual_seed(0)
    pairs = [(list(range(1, 1 + n)), list(range(1, 1 + m)))
             for n, m in torch.randint(1, 60, (300, 2), generator=g).tolist()]
    buckets = length_buckets(64)
    batcher = TokenBatcher(pairs, 512, seed=0, buckets=buckets)
    batches = list(batcher.batches(0))
    shapes = {tuple(b.src.shape) for b in batches}
    assert shapes <= {(512 // L, L) for L in buckets}
    assert all(tuple(b.tgt_in.shape) == tuple(b.src.shape) for b in batches)
    assert sum(b.num_tokens for b in batches) == sum(len(t) + 1 for _, t in pairs)
    assert sum(int(b.src_mask.any(dim=1).sum()) for b in batches) == len(pairs)


# ------------------------------------------------------------------ no recompiles
def test_compiled_language_model_training_compiles_once(tmp_path, counting):
    cfg = tiny_lm(tmp_path, "train.steps=12", "train.eval_every=6", "train.compile=true")
    result = train(cfg, tmp_path / "run", **QUIET)
    assert counting.graphs == 1  # step 1; never again (evaluation runs eager)
    assert len(result.losses) == 12


@pytest.mark.parametrize("make", [tiny_pairs, lambda tmp, *o: tiny_task(*o, "data.task_min_len=1", "train.batch_size=2")])
def test_compiled_seq2seq_compiles_once_per_bucket_shape(tmp_path, counting, monkeypatch, make):
    monkeypatch.setattr(buckets_module, "_SMALLEST", 4)  # buckets 4, 6, 8, 12, ...: tiny data spans several
    seen = _shapes_seen(monkeypatch)
    cfg = make(tmp_path, "train.steps=40", "train.eval_every=0", "train.compile=true")
    train(cfg, tmp_path / "run", **QUIET)
    distinct = set(seen)
    assert len(seen) == 40 and 1 < len(distinct) <= len(length_buckets(cfg.model.max_seq_len))
    assert counting.graphs == len(distinct)  # each shape traced once: no recompiles after its first step
    first_seen = {s: seen.index(s) for s in distinct}
    assert max(first_seen.values()) < 20  # warm-up is over early; the last 20 steps compiled nothing


# ------------------------------------------------------------------ same training
def _eager_on_the_same_batches(cfg, run_dir):
    """``train.compile=true`` batches (seq2seq: padded to buckets), the loss run eagerly."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(loop_module, "compile_loss", lambda objective, *a, **k: objective.loss)
        return train(cfg, run_dir, **QUIET)


@pytest.mark.parametrize("backend,tol", [("aot_eager", 1e-4), pytest.param("inductor", 2e-3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("make", [tiny_lm, tiny_pairs])
def test_compiled_and_eager_training_give_the_same_loss_curve(tmp_path, monkeypatch, make, backend, tol):
    """AOTAutograd traces forward and backward (what inductor compiles) and runs the traced
    graphs (``aot_eager``), or inductor compiles them; 20 steps match eager training step for step."""
    torch._dynamo.reset()
    monkeypatch.setattr(compile_module, "BACKEND", backend)
    cfg = make(tmp_path, "train.steps=20", "train.eval_every=0", "train.lr=3e-3", "train.warmup=2",
               "train.compile=true")
    eager = _eager_on_the_same_batches(cfg, tmp_path / "eager")
    compiled = train(cfg, tmp_path / "compiled", **QUIET)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled.losses, eager.losses, atol=tol, rtol=min(tol, 1e-3))
    assert compiled.losses[-1] < compiled.losses[0] - 0.3  # it trains


def test_auto_compiles_only_models_whose_blocks_hold_20m_weights():
    """``train.compile=auto`` (the default) follows the measured break-even: GPT-2 small's
    shape (85M block weights) compiles, nanoGPT's CPU shape (0.8M) and the translator do not;
    an explicit setting wins."""
    from blockformer.run_config import load_run_config  # noqa: PLC0415
    from blockformer.stats import block_weights  # noqa: PLC0415
    from blockformer.train.compile import resolve_compile  # noqa: PLC0415

    gpt2 = TransformerConfig(arch="decoder", vocab_size=50257, d_model=768, n_layers=12, n_heads=12)
    assert block_weights(gpt2) == 12 * (4 * 768 * 768 + 2 * 768 * 3072)  # 84.9M: attention + FFN
    assert resolve_compile("auto", gpt2) is True
    assert resolve_compile(False, gpt2) is False
    tiny = load_run_config(preset="char-lm-tiny")
    assert tiny.train.compile == "auto" and block_weights(tiny.model) == 786_432
    assert resolve_compile("auto", tiny.model) is False
    assert resolve_compile(True, tiny.model) is True
    assert resolve_compile("auto", load_run_config(preset="translate-small").model) is False
    assert resolve_compile("auto", load_run_config(preset="original-base").model) is True  # 44M
    assert load_run_config(preset="char-lm-tiny", overrides=["train.compile=true"]).train.compile is True
    with pytest.raises(Exception, match="train.compile"):
        load_run_config(preset="char-lm-tiny", overrides=["train.compile=sometimes"])


def test_a_default_run_of_a_small_model_trains_eagerly(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(loop_module, "compile_loss", lambda objective: calls.append(1) or objective.loss)
    train(tiny_lm(tmp_path, "train.steps=2", "train.eval_every=0"), tmp_path / "run", **QUIET)
    assert calls == []
    train(tiny_lm(tmp_path, "train.steps=2", "train.eval_every=0", "train.compile=true"), tmp_path / "run2", **QUIET)
    assert calls == [1]
