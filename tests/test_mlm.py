"""Masked language modelling: BERT's corruption rates on a large draw, loss only where masked,
and an encoder that learns from the same text a decoder does."""

import pytest
import torch

from blockformer.data.masking import MASK_ID, MaskingRates, mask_tokens
from blockformer.errors import UsageError
from blockformer.nn.loss import token_loss
from blockformer.run_config import load_run_config
from blockformer.tokenizers import PAD_ID
from blockformer.train import train
from blockformer.train.load import load_checkpoint
from blockformer.train.mlm import MaskedLM

QUIET = dict(log=lambda *a: None)
V = 260


def _draw(rates: MaskingRates, shape=(256, 512)):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, V, shape, generator=g)
    inputs, targets = mask_tokens(tokens, V, rates, g)
    return tokens, inputs, targets


@pytest.mark.parametrize("rates", [MaskingRates(), MaskingRates(0.3, 0.5, 0.25)])
def test_masking_rates_match_the_configured_ones_on_a_large_draw(rates):
    """131k positions: the selected share is within 0.005 of mask_rate; of the selected, the
    shares masked / randomised / kept are within 0.01 of the configured split."""
    tokens, inputs, targets = _draw(rates)
    selected = targets != PAD_ID
    assert abs(selected.float().mean().item() - rates.mask_rate) < 0.005
    n = selected.sum().item()
    masked = (inputs == MASK_ID) & selected
    changed = (inputs != tokens) & ~masked & selected
    kept = (inputs == tokens) & selected
    # a random replacement equal to the original token (1 in 256) counts as kept
    p_same = 1 / (V - 4)
    assert abs(masked.sum().item() / n - rates.mask_token_rate) < 0.01
    assert abs(changed.sum().item() / n - rates.random_token_rate * (1 - p_same)) < 0.01
    keep_rate = 1 - rates.mask_token_rate - rates.random_token_rate
    assert abs(kept.sum().item() / n - (keep_rate + rates.random_token_rate * p_same)) < 0.01
    # nothing outside the selection changes, and targets there are padding (ignored)
    assert torch.equal(inputs[~selected], tokens[~selected])
    assert torch.equal(targets[selected], tokens[selected])
    assert ((inputs[changed] >= 4) & (inputs[changed] < V)).all()  # random ids are ordinary tokens


def test_special_tokens_are_never_selected():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4, (64, 64), generator=g)  # only specials
    inputs, targets = mask_tokens(tokens, V, MaskingRates(0.5), g)
    assert torch.equal(inputs, tokens) and (targets == PAD_ID).all()


class _FixedLogits(torch.nn.Module):
    """A 'model' whose logits are a parameter: its gradient shows which positions the loss reads."""

    def __init__(self, B, T):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(B, T, V, generator=torch.Generator().manual_seed(0)))

    def forward(self, tokens, targets=None, label_smoothing=0.0):  # the models' contract: a loss given targets
        return self.logits if targets is None else token_loss(self.logits, targets, label_smoothing)


def test_the_mlm_loss_reads_only_the_selected_positions():
    """The summed loss equals the cross-entropy over the selected positions by hand, and the
    gradient is exactly zero at every other position."""
    tokens, inputs, targets = _draw(MaskingRates(), shape=(4, 64))
    model = _FixedLogits(4, 64)
    objective = MaskedLM.__new__(MaskedLM)  # only loss/count_targets are used
    loss = objective.loss(model, (inputs, targets))
    selected = targets != PAD_ID
    logp = model.logits.detach().log_softmax(-1)
    by_hand = -logp[selected].gather(-1, tokens[selected][:, None]).sum()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert objective.count_targets((inputs, targets)) == int(selected.sum())
    loss.backward()
    grad_norm = model.logits.grad.abs().sum(-1)
    assert (grad_norm[~selected] == 0).all() and (grad_norm[selected] > 0).all()


def _tiny_mlm(tmp_path, *overrides):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(300)))
    data = [f"data.text={corpus}", "data.tokenizer=byte", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    model = ["model.arch=encoder", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32"]
    return load_run_config(overrides=[*model, *data, "train.batch_size=16", "train.progress=false", *overrides])


@pytest.mark.slow
def test_an_encoder_learns_text_by_mlm_and_reports_masked_accuracy(tmp_path):
    """objective=auto with an encoder on text is MLM: 300 steps on a repetitive corpus take
    the held-out masked-token accuracy from chance (1/256) to above 40%."""
    cfg = _tiny_mlm(tmp_path, "train.steps=300", "train.eval_every=0", "train.lr=3e-3", "train.warmup=10")
    result = train(cfg, tmp_path / "run", **QUIET)
    assert result.val["masked_accuracy"] > 0.4, result.val
    assert result.val["val_loss"] < 2.5
    ckpt = load_checkpoint(result.best or result.checkpoint)
    assert ckpt.config.model.arch == "encoder"
    assert ckpt.model.head.weight is ckpt.model.embed.tokens.weight  # the MLM head is tied


def test_mlm_on_a_decoder_is_a_usage_error(tmp_path):
    cfg = _tiny_mlm(tmp_path, "model.arch=decoder", "train.objective=mlm")
    with pytest.raises(UsageError, match="train.objective='mlm'"):
        train(cfg, tmp_path / "run", **QUIET)


def test_masking_rates_are_validated():
    with pytest.raises(UsageError, match="mask_token_rate"):
        load_run_config(overrides=["train.mask_token_rate=0.9", "train.random_token_rate=0.2"])


def test_eval_on_an_mlm_checkpoint_scores_masked_tokens(tmp_path, capsys):
    import json

    from blockformer.cli import main

    result = train(_tiny_mlm(tmp_path, "train.steps=2", "train.eval_every=0"), tmp_path / "run", **QUIET)
    args = ["eval", "--checkpoint", str(result.checkpoint), "--data", str(tmp_path / "corpus.txt"), "--json"]
    assert main(args) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert 0 <= metrics["masked_accuracy"] <= 1 and 0 < metrics["val_loss"] < 10
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == metrics  # the same fixed masks every time
