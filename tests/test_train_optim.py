"""AdamW grouping (no decay on norms, biases, embeddings, gates) and the label-smoothed loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from blockformer import TransformerConfig, build_model
from blockformer.run_config import TrainConfig
from blockformer.nn.loss import token_loss
from blockformer.train.optim import build_optimizer, param_groups


def _names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_only_matrices_of_linear_layers_are_decayed():
    cfg = TransformerConfig(arch="encoder-decoder", d_model=32, n_heads=4, n_layers=1, vocab_size=50,
                            residual="gated", position="learned", max_seq_len=16, tie_embeddings=False)
    model = build_model(cfg)
    decay, no_decay = param_groups(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    decayed = _names(model, decay["params"])
    kept = _names(model, no_decay["params"])
    assert decayed and kept and not decayed & kept
    assert all(n.endswith(".weight") for n in decayed)
    assert not any("norm" in n or "embed" in n or "gate" in n for n in decayed)
    assert "head.weight" in decayed  # an untied output projection is a matmul
    assert all(p.dim() == 1 for p in no_decay["params"] if p.dim() != 2)  # biases, norm gains, gates
    embeddings = {n for n in kept if "embed" in n}
    tables = {"tgt_embed.tokens.weight", "src_embed.tokens.weight", "tgt_embed.position.table.weight"}
    assert tables <= embeddings
    # every parameter appears exactly once
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_a_tied_head_shares_the_embedding_and_is_not_decayed():
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=50, tie_embeddings=True)
    model = build_model(cfg)
    decay, no_decay = param_groups(model, 0.1)
    assert any(p is model.embed.tokens.weight for p in no_decay["params"])
    assert not any(p is model.head.weight for p in decay["params"])


def test_build_optimizer_sets_betas_eps_and_lr():
    model = build_model(TransformerConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=50))
    opt = build_optimizer(model, TrainConfig(lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-9, weight_decay=0.05))
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.98), 1e-9, 0.05)


def test_label_smoothed_loss_equals_the_closed_form():
    torch.manual_seed(0)
    V, eps = 7, 0.1
    logits = torch.randn(2, 5, V)
    targets = torch.tensor([[4, 5, 6, 1, 0], [2, 3, 0, 0, 0]])  # 0 is padding
    got = token_loss(logits, targets, label_smoothing=eps)
    logp = logits.log_softmax(-1)
    expected = 0.0
    for b in range(2):
        for t in range(5):
            y = int(targets[b, t])
            if y == 0:
                continue
            q = torch.full((V,), eps / V)
            q[y] += 1 - eps
            expected += float(-(q * logp[b, t]).sum())
    assert float(got) == pytest.approx(expected, rel=1e-5)
    # (1 - eps) * NLL + eps * mean over classes of -log p, summed over the 6 real tokens
    mask = targets != 0
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    alt = ((1 - eps) * nll + eps * (-logp).mean(-1))[mask].sum()
    assert float(got) == pytest.approx(float(alt), rel=1e-5)


def test_loss_without_smoothing_is_the_summed_nll_and_ignores_padding():
    logits = torch.zeros(1, 3, 4)  # uniform: each real token costs log 4
    targets = torch.tensor([[1, 2, 0]])
    assert float(token_loss(logits, targets)) == pytest.approx(2 * math.log(4), rel=1e-6)
    reference = F.cross_entropy(logits[0, :2], targets[0, :2], reduction="sum")
    assert float(token_loss(logits, targets)) == pytest.approx(float(reference))
