"""``train.batch_threads``: a micro-batch's rows split over CPU threads in one process.

The shards run at the same time (a barrier only both can pass), each on its share of
torch's threads; their gradients equal the unsplit step's to rounding and repeat bit for
bit, dropout masks included (each shard draws them from its own generator); ``"auto"``
splits only where nothing shares state between threads, and an explicit number that
cannot be honoured is refused naming the setting in the way.
"""

import dataclasses
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from blockformer.config import TransformerConfig
from blockformer.errors import UsageError
from blockformer.models import build_model
from blockformer.parallel.data import batch_rows
from blockformer.parallel.threads import AUTO_MAX_THREADS, RowThreads, resolve_batch_threads
from blockformer.precision import grad_scaler
from blockformer.run_config import TrainConfig
from blockformer.train import train
from blockformer.train.load import load_checkpoint
from blockformer.train.step import train_step
from blockformer.train.objective import LanguageModelling, Seq2Seq

from test_train_loop import QUIET, tiny_lm, tiny_pairs

CFG = TransformerConfig(arch="decoder", vocab_size=50, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16)


def _model(**changes) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(dataclasses.replace(CFG, **changes)).train()


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab_size, (rows, 12), generator=g)
    return x, torch.roll(x, -1, 1)


def _loss(model):
    return lambda b: model(b[0], targets=b[1])  # the summed token loss, as LanguageModelling's


def _grads(model, n: int, batch, calls: int = 1, random: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    with RowThreads(n, random=random) as threads:
        loss = sum(threads.backward(_loss(model), batch, params, 1 / batch[1].numel()) for _ in range(calls))
    return loss, [p.grad.clone() for p in params]


@pytest.mark.parametrize("n, rows", [(2, 8), (3, 7), (4, 3)])
def test_split_rows_give_the_unsplit_loss_and_gradients(n, rows):
    """Shards of unequal size too (7 rows over 3 threads), and fewer rows than threads."""
    model, batch = _model(), _batch(rows)
    loss_1, grads_1 = _grads(model, 1, batch)
    loss_n, grads_n = _grads(model, n, batch)
    torch.testing.assert_close(loss_n, loss_1, rtol=1e-6, atol=1e-5)
    for a, b in zip(grads_n, grads_1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert max(float(g.abs().max()) for g in grads_1) > 1e-3  # the comparison is not of zeros


def test_gradients_accumulate_over_micro_batches():
    model, batch = _model(), _batch(6)
    _, once = _grads(model, 2, batch)
    _, twice = _grads(model, 2, batch, calls=2)
    for a, b in zip(twice, once):
        torch.testing.assert_close(a, 2 * b)


def test_a_split_step_repeats_bit_for_bit():
    model, batch = _model(), _batch(8)
    first, second = _grads(model, 2, batch)[1], _grads(model, 2, batch)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_dropout_masks_come_from_each_shards_own_generator_and_repeat():
    """The shards draw no masks from torch's generator (only one seed per shard, in shard
    order, so the global stream ends where those draws leave it); the same global seed gives
    the same masks bit for bit, another seed other masks."""
    model, batch = _model(dropout=0.5), _batch(8)

    def split(seed: int):
        torch.manual_seed(seed)
        loss, grads = _grads(model, 2, batch, random=True)
        return loss, grads, torch.get_rng_state()

    torch.manual_seed(3)
    torch.randint(1 << 62, (2,))
    after_seeds = torch.get_rng_state()
    (loss_a, grads_a, state_a), (loss_b, grads_b, _) = split(3), split(3)
    assert torch.equal(state_a, after_seeds)
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert not torch.equal(split(4)[0], loss_a)
    # two shards of the same rows: equal losses would mean one mask stream for both
    half = _batch(4)
    twice, shard_losses, loss = (torch.cat([half[0]] * 2), torch.cat([half[1]] * 2)), [], _loss(model)
    with RowThreads(2, random=True) as threads:
        threads.backward(lambda b: shard_losses.append(loss(b)) or shard_losses[-1], twice,
                         list(model.parameters()), 1.0)
    assert len(shard_losses) == 2 and not torch.equal(shard_losses[0], shard_losses[1])


def test_shards_run_at_the_same_time_each_on_its_share_of_threads():
    """Each shard waits at a barrier only two threads running at once can pass; each sees
    torch's threads divided between the shards; the caller keeps its share until the rows'
    threads close (``all_threads`` lends the whole count back for a block)."""
    model, batch = _model(), _batch(4)
    barrier, seen = threading.Barrier(2, timeout=30), []
    loss = _loss(model)

    def shard_loss(b):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        barrier.wait()  # BrokenBarrierError if the other shard is not running meanwhile
        return loss(b)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with RowThreads(2) as threads:
            threads.backward(shard_loss, batch, list(model.parameters()), 1.0)
            held = torch.get_num_threads()  # the caller keeps its share until released
            with threads.all_threads():
                lent = torch.get_num_threads()
            assert (held, lent, torch.get_num_threads()) == (1, 2, 1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert len({ident for ident, _ in seen}) == 2
    assert [count for _, count in seen] == [1, 1]


def test_an_error_in_one_shard_is_raised_once_every_shard_has_finished():
    model, batch = _model(), _batch(4)
    finished, loss = [], _loss(model)

    def shard_loss(b):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("shard broke")
        out = loss(b)
        finished.append(True)
        return out

    threads_before = torch.get_num_threads()
    with RowThreads(2) as threads, pytest.raises(ValueError, match="shard broke"):
        threads.backward(shard_loss, batch, list(model.parameters()), 1.0)
    assert finished == [True] and torch.get_num_threads() == threads_before


CPU = torch.device("cpu")
PLAIN = TrainConfig(precision="fp32", compile=False)


@pytest.mark.parametrize("change, reason", [
    (dict(device=torch.device("cuda")), "train.device"),
    (dict(parallel=True), "multi-process"),
    (dict(tc=dataclasses.replace(PLAIN, compile=True)), "train.compile"),
    (dict(tc=dataclasses.replace(PLAIN, precision="fp16")), "fp16"),
    (dict(splittable=False), "labelled"),
    (dict(tc=dataclasses.replace(PLAIN, activation_checkpointing="full")), "activation_checkpointing"),
    (dict(model=_model(ffn_experts=2)), "MoE"),
])
def test_auto_leaves_rows_whole_where_threads_would_share_state_and_a_number_is_refused(change, reason):
    args = dict(model=_model(), tc=PLAIN, device=CPU, parallel=False) | change
    assert resolve_batch_threads("auto", threads=2, **args) == 1
    assert resolve_batch_threads(1, threads=2, **args) == 1
    with pytest.raises(UsageError, match=f"train.batch_threads=2: .*{reason}"):
        resolve_batch_threads(2, threads=2, **args)


def test_auto_splits_over_torchs_threads_on_a_small_cpu_only():
    args = dict(model=_model(), tc=PLAIN, device=CPU)
    assert resolve_batch_threads("auto", threads=2, **args) == 2
    assert resolve_batch_threads("auto", threads=2, **(args | dict(model=_model(dropout=0.1, attention_dropout=0.1)))) == 2
    assert resolve_batch_threads("auto", threads=2, **(args | dict(tc=dataclasses.replace(PLAIN, precision="bf16")))) == 2
    assert resolve_batch_threads("auto", threads=1, **args) == 1
    assert resolve_batch_threads("auto", threads=AUTO_MAX_THREADS + 1, **args) == 1
    assert resolve_batch_threads(3, threads=8, **args) == 3  # a number is taken as given


@pytest.mark.parametrize("kind", ["lm", "pairs"])
def test_a_run_split_over_threads_trains_as_the_unsplit_run(tmp_path, kind, monkeypatch):
    """Language modelling and padded seq2seq batches, with gradient accumulation: each
    training loss is computed on two threads, half the rows each; the losses agree to
    rounding, and the log says the rows were split."""
    make, objective = {"lm": (tiny_lm, LanguageModelling), "pairs": (tiny_pairs, Seq2Seq)}[kind]
    extra = ("train.steps=8", "train.eval_every=0", "train.log_every=2", "train.grad_accum=2", "train.precision=fp32")
    original, calls = objective.loss, []

    def loss(self, model, batch, *args):
        if model.training:
            calls.append((threading.get_ident(), batch_rows(batch)))
        return original(self, model, batch, *args)

    monkeypatch.setattr(objective, "loss", loss)
    lines = []
    split = train(make(tmp_path, *extra, "train.batch_threads=2"), tmp_path / "split", log=lines.append)
    split_calls, calls[:] = list(calls), []
    whole = train(make(tmp_path, *extra, "train.batch_threads=1"), tmp_path / "whole", **QUIET)
    torch.testing.assert_close(torch.tensor(split.losses), torch.tensor(whole.losses), rtol=1e-5, atol=1e-6)
    assert any("split over 2 threads" in str(line) for line in lines)
    assert len(split_calls) == 2 * len(calls) == 2 * 16 and len({ident for ident, _ in split_calls}) == 2
    assert sum(rows for _, rows in split_calls) == sum(rows for _, rows in calls)


class _Recorder(torch.optim.Optimizer):
    """Keeps the gradients ``train_step`` hands the optimizer; changes nothing."""

    def __init__(self, params) -> None:
        super().__init__(list(params), {"lr": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        self.grads = [p.grad.clone() for g in self.param_groups for p in g["params"]]


class _Rows:
    """What ``train_step`` asks of an objective when it is given the loss: a target count."""

    @staticmethod
    def count_targets(batch) -> int:
        return batch[1].numel()


def test_a_bf16_shard_keeps_its_own_weight_casts_whatever_the_other_shard_does():
    """torch keeps one cache of autocast's cast weights for the whole process and empties it
    whenever a thread leaves autocast. Shard 0 uses one weight twice; shard 1 leaves autocast
    either between those two uses or after both. A shared cast would sum the two uses'
    gradients in bf16 in one case and in fp32 in the other: the split step's gradient must
    not depend on which thread got where first."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16, bias=False)
    batch, caller = (torch.randn(4, 16), torch.zeros(4, 16)), threading.get_ident()
    tc = TrainConfig(precision="bf16", compile=False, grad_clip=0.0)

    def step(between: bool) -> torch.Tensor:
        left, used = threading.Event(), threading.Event()

        def loss_fn(_, rows, smoothing):
            h = F.linear(rows[0], model.weight)
            if threading.get_ident() == caller:  # shard 0
                assert not between or left.wait(10)
                h = F.linear(h, model.weight)
                used.set()
            else:  # its backward (the hook) starts after it has left autocast
                assert between or used.wait(10)
                h.register_hook(lambda g: left.set())
            return h.float().square().sum()

        recorder = _Recorder(model.parameters())
        with RowThreads(2) as threads:
            train_step(model, _Rows(), [batch], recorder, grad_scaler("bf16", CPU), list(model.parameters()), tc, CPU,
                       loss_fn=loss_fn, threads=threads)
        return recorder.grads[0]

    assert torch.equal(step(between=True), step(between=False))


def test_a_split_bf16_encoder_decoder_run_repeats_itself(tmp_path):
    """Padded seq2seq batches of changing shapes, tied embeddings, bf16 autocast: two runs in
    one process give the same losses bit for bit (they drifted apart in the 7th digit after
    tens of steps while the shards shared autocast's cast weights)."""
    cfg = tiny_pairs(tmp_path, "train.steps=120", "train.eval_every=0", "train.log_every=1",
                     "train.precision=bf16", "train.batch_threads=2")
    first, second = (train(cfg, tmp_path / name, **QUIET).losses for name in ("a", "b"))
    assert len(first) == 120 and first == second


def test_a_split_run_with_dropout_resumes_exactly(tmp_path):
    """20 steps in one go == 10, stop, resume, 10 more, loss for loss and bit for bit, with
    dropout and attention dropout drawn per shard and gradient accumulation."""
    cfg = tiny_lm(tmp_path, "train.steps=20", "train.eval_every=0", "train.log_every=3", "train.grad_accum=2",
                  "model.dropout=0.1", "model.attention_dropout=0.1", "train.batch_threads=2")
    straight = train(cfg, tmp_path / "a", **QUIET)
    first = train(cfg, tmp_path / "b", stop_at=10, **QUIET)
    second = train(cfg, tmp_path / "b", resume=tmp_path / "b", **QUIET)
    assert first.losses + second.losses == straight.losses and len(straight.losses) == 20
    a, b = load_checkpoint(straight.checkpoint), load_checkpoint(second.checkpoint)
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_the_cli_refuses_threads_it_cannot_honour(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh " * 200)
    base = [sys.executable, "-m", "blockformer", "train", "--out", str(tmp_path / "run"), "--set", f"data.text={corpus}",
            "--set", "data.tokenizer=char", "--set", "train.steps=1"]
    for extra, expected in [(["train.batch_threads=0"], "train.batch_threads=0: expected an integer >= 1"),
                            (["train.batch_threads=2", "model.ffn_experts=2"], "train.batch_threads=2: rows cannot")]:
        sets = [a for s in extra for a in ("--set", s)]
        proc = subprocess.run(base + sets, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr
