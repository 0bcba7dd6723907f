"""The mixture-of-experts FFN: dense at E=1, a per-token reference, the auxiliary losses,
capacity and dropping, gradients, the KV cache, compile, quantized decoding, counts, logs."""

import json
import math

import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.nn.feedforward import FeedForward
from blockformer.nn.moe import MoEFeedForward, auxiliary_loss, routing_stats
from blockformer.stats import active_parameters, count_parameters, flops_per_token
from cached import cached_logits


def moe_cfg(**kw):
    base = dict(d_model=16, n_heads=2, ffn="gelu", ffn_experts=4, experts_top_k=2, d_ff=24, init_std=0.3)
    base.update(kw)
    return TransformerConfig(**base)


def reference(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in plain Python: the definition of the layer."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = (x[n] @ moe.router.t()).softmax(-1)
        w, e = probs.topk(moe.top_k)
        if moe.top_k > 1:
            w = w / w.sum()
        for weight, expert in zip(w, e.tolist()):
            h = x[n] @ moe.w_up[expert] + (moe.b_up[expert] if moe.b_up is not None else 0)
            if moe.gated:
                gate, h = h.chunk(2)
                h = moe.act(gate) * h
            else:
                h = moe.act(h)
            out[n] += weight * (h @ moe.w_down[expert] + (moe.b_down[expert] if moe.b_down is not None else 0))
        if moe.shared is not None:
            out[n] += moe.shared(x[n])
    return out


@pytest.mark.parametrize("ffn,approx", [("relu", "none"), ("gelu", "none"), ("gelu", "tanh"), ("swiglu", "none"),
                                        ("geglu", "tanh")])
def test_one_expert_top_one_equals_the_dense_ffn_with_the_same_weights(ffn, approx):
    cfg = moe_cfg(ffn=ffn, gelu_approximate=approx, ffn_experts=1, experts_top_k=1, router_aux_coef=0.0,
                  router_z_coef=0.0)
    torch.manual_seed(0)
    moe, dense = MoEFeedForward(cfg), FeedForward(cfg)
    with torch.no_grad():
        moe.w_up[0].copy_(dense.up.weight.t())
        moe.w_down[0].copy_(dense.down.weight.t())
        moe.b_up[0].copy_(dense.up.bias)
        moe.b_down[0].copy_(dense.down.bias)
    x = torch.randn(3, 7, 16)
    torch.testing.assert_close(moe(x), dense(x), atol=1e-6, rtol=1e-6)
    assert moe.aux_loss.item() == 0.0


@pytest.mark.parametrize("path", ["grouped", "padded"])
@pytest.mark.parametrize("ffn,shared,bias,k", [("gelu", 0, True, 2), ("swiglu", 1, False, 2), ("relu", 0, True, 1),
                                                ("geglu", 2, True, 3)])
def test_routed_output_equals_a_per_token_reference_loop(ffn, shared, bias, k, path, monkeypatch):
    if path == "padded":  # the fallback when grouped_mm does not apply
        monkeypatch.setattr("blockformer.nn.moe._grouped_mm_ok", lambda *a: False)
    torch.manual_seed(1)
    moe = MoEFeedForward(moe_cfg(ffn=ffn, shared_experts=shared, bias=bias, experts_top_k=k))
    if bias:
        with torch.no_grad():
            moe.b_up.normal_(0, 0.3), moe.b_down.normal_(0, 0.3)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).reshape(-1, 16), reference(moe, x.reshape(-1, 16)), atol=1e-6, rtol=1e-5)


def test_grouped_mm_is_the_path_taken_when_it_applies():
    from blockformer.nn.moe import _grouped_mm_ok

    moe = MoEFeedForward(moe_cfg())
    xs = torch.randn(4, 16)
    assert _grouped_mm_ok(xs, moe.w_up, moe.w_down, torch.float32)
    assert _grouped_mm_ok(xs, moe.w_up, moe.w_down, torch.bfloat16)
    odd = MoEFeedForward(moe_cfg(d_model=18, n_heads=3, d_ff=10, position="none"))  # rows of 18 * 4 bytes: not 16-aligned
    assert not _grouped_mm_ok(torch.randn(4, 18), odd.w_up, odd.w_down, torch.float32)


def test_balance_loss_is_k_at_perfect_balance_and_matches_a_hand_computation():
    moe = MoEFeedForward(moe_cfg(ffn_experts=4, experts_top_k=2, router_aux_coef=1.0, router_z_coef=0.0))
    # Perfect balance: 4 tokens, each expert chosen by exactly 2 of them, probabilities uniform
    # over a token's two choices -> f_e = 2/4, P_e = 1/4 for every e.
    big = 20.0
    logits = torch.tensor([[big, big, 0, 0], [0, 0, big, big], [big, 0, big, 0], [0, big, 0, big]])
    experts = logits.topk(2, dim=-1).indices
    moe._record_losses(logits, experts, None)
    assert moe.stats["balance_loss"].item() == pytest.approx(2.0, abs=1e-6)
    # Skewed, by hand: 2 tokens, E=4, k=2; both choose experts 0 and 1.
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    p = logits.softmax(-1)  # rows (a, b, c, c) and (b, a, c, c)
    a, b, c = p[0, 0].item(), p[0, 1].item(), p[0, 2].item()
    f = [1.0, 1.0, 0.0, 0.0]
    P = [(a + b) / 2, (a + b) / 2, c, c]
    hand = 4 * sum(fi * Pi for fi, Pi in zip(f, P))  # = 4 (a + b) > k
    moe._record_losses(logits, logits.topk(2, dim=-1).indices, None)
    assert moe.stats["balance_loss"].item() == pytest.approx(hand, rel=1e-6)
    assert hand == pytest.approx(4 * (a + b)) and hand > 2.0 + 1.0
    # z-loss by hand: mean of logsumexp^2.
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 2
    assert moe.stats["z_loss"].item() == pytest.approx(z, rel=1e-6)
    assert moe.aux_loss.item() == pytest.approx(hand, rel=1e-6)  # coefficients 1 and 0


def test_padding_is_left_out_of_the_losses_and_the_load():
    torch.manual_seed(0)
    moe = MoEFeedForward(moe_cfg())
    x = torch.randn(1, 10, 16)
    valid = torch.tensor([[True] * 6 + [False] * 4])
    y = moe(x, valid)
    masked_aux, masked_load = moe.aux_loss.clone(), moe.stats["load"].clone()
    y_real = moe(x[:, :6])
    torch.testing.assert_close(moe.aux_loss, masked_aux)
    assert masked_load.tolist() == moe.stats["load"].tolist() and int(masked_load.sum()) == 6 * 2
    torch.testing.assert_close(y[:, :6], y_real, atol=1e-6, rtol=1e-6)
    assert y[:, 6:].abs().max() == 0  # padding is routed nowhere


def test_assignments_past_capacity_are_dropped_and_their_tokens_get_no_ffn_output():
    cfg = moe_cfg(ffn_experts=4, experts_top_k=1, expert_capacity_factor=1.0)
    moe = MoEFeedForward(cfg).train()
    with torch.no_grad():  # every token prefers expert 2
        moe.router.zero_()
        moe.router[2].fill_(1.0)
    x = torch.rand(1, 8, 16) + 0.1  # positive, so x . router[2] > 0 = the others
    y = moe(x)  # capacity = 1.0 * 8 * 1 / 4 = 2 slots: tokens 0 and 1 are served
    assert moe.stats["dropped"].item() == 6 and moe.stats["load"].tolist() == [0, 0, 8, 0]
    assert y[0, 2:].abs().max() == 0  # dropped: the block adds nothing, the residual carries x
    with torch.no_grad():
        torch.testing.assert_close(y[0, :2], reference(moe, x[0, :2]), atol=1e-6, rtol=1e-5)
        # Evaluation is dropless: every token gets its expert.
        torch.testing.assert_close(moe.eval()(x)[0], reference(moe, x[0]), atol=1e-6, rtol=1e-5)
    assert routing_stats(torch.nn.Sequential(moe))["dropped"] == 0.0


def test_a_block_passes_a_dropped_token_through_its_residual_only():
    from blockformer import Block

    cfg = moe_cfg(ffn_experts=2, experts_top_k=1, expert_capacity_factor=0.25, n_heads=2)
    block = Block(cfg, causal=False).train()
    with torch.no_grad():
        block.ffn.router.zero_()
        block.ffn.router[0, 0] = 50.0  # routing decided by channel 0 of the normed input
    x = torch.randn(1, 8, 16)
    captured = {}
    block.attn.register_forward_hook(lambda m, i, o: captured.setdefault("attn", o))
    y = block(x)
    r = x + captured["attn"]  # the stream after attention
    dropped = [n for n in range(8) if (y[0, n] - r[0, n]).abs().max() == 0]
    assert len(dropped) >= 8 - 2 * 1  # at most one slot per expert: 2 tokens served
    assert block.ffn.stats["dropped"].item() == len(dropped)


def test_capacity_path_with_room_for_all_equals_the_reference():
    torch.manual_seed(2)
    moe = MoEFeedForward(moe_cfg(expert_capacity_factor=4.0)).train()  # capacity = N * k: nothing drops
    x = torch.randn(2, 5, 16)
    y = moe(x)
    assert moe.stats["dropped"].item() == 0
    with torch.no_grad():
        torch.testing.assert_close(y.reshape(-1, 16), reference(moe, x.reshape(-1, 16)), atol=1e-6, rtol=1e-5)


def test_gradients_reach_the_router_through_the_gates_and_the_aux_loss():
    torch.manual_seed(0)
    moe = MoEFeedForward(moe_cfg(router_aux_coef=0.0, router_z_coef=0.0))
    moe(torch.randn(2, 6, 16)).pow(2).sum().backward()
    assert moe.router.grad.abs().sum() > 0 and moe.w_up.grad.abs().sum() > 0
    one = MoEFeedForward(moe_cfg(experts_top_k=1, router_aux_coef=0.1, router_z_coef=0.0))
    one(torch.randn(2, 6, 16))
    one.aux_loss.backward()  # the balance loss alone moves the router (through P_e)
    assert one.router.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_every_architecture_builds_with_moe_and_reports_its_aux_loss(arch):
    cfg = TransformerConfig(arch=arch, vocab_size=30, d_model=16, n_layers=2, n_heads=2, ffn_experts=4,
                            experts_top_k=2, shared_experts=1, position="rope")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 30, (2, 6))
    out = model(tokens, tokens) if arch == "encoder-decoder" else model(tokens)
    assert torch.isfinite(out).all()
    aux = auxiliary_loss(model)
    assert aux is not None and aux.requires_grad and aux.item() >= 0.01 * 2 - 1e-6  # balance >= k
    n_moe = sum(isinstance(m, MoEFeedForward) for m in model.modules())
    assert n_moe == (4 if arch == "encoder-decoder" else 2)
    assert auxiliary_loss(build_model(TransformerConfig(arch=arch, vocab_size=30, d_model=16, n_heads=2))) is None


@pytest.mark.parametrize("position", ["rope", "alibi", "learned"])
def test_decoder_cache_equals_the_full_forward_with_moe_blocks(position):
    cfg = TransformerConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, position=position, ffn="swiglu",
                            ffn_experts=4, experts_top_k=2, expert_capacity_factor=1.0, init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, 37, (2, 11))
    torch.testing.assert_close(cached_logits(model, tokens, 4, 16), model(tokens), atol=1e-5, rtol=1e-5)


def test_moe_decoder_traces_as_one_graph_and_matches_eager():
    torch._dynamo.reset()
    cfg = TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, ffn_experts=4, experts_top_k=2)
    model = build_model(cfg, seed=0)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    tokens = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(compiled(tokens), model(tokens), atol=1e-5, rtol=1e-5)
    aux = auxiliary_loss(model)  # recorded by the compiled forward, still attached to its graph
    assert aux is not None and aux.requires_grad
    aux.backward()
    assert model.decoder.blocks[0].ffn.router.grad is not None
    model.eval()
    cache = model.new_cache(2, 12)
    compiled(tokens, cache=cache, cache_pos=torch.arange(8))
    step = compiled(tokens[:, :1], cache=cache, cache_pos=torch.tensor([8]))
    assert step.shape == (2, 1, 50)


def test_int8_experts_are_within_half_a_step_per_weight():
    torch.manual_seed(0)
    moe = MoEFeedForward(moe_cfg())
    exact = {name: moe.weight(name, torch.float32).detach().clone() for name in ("w_up", "w_down")}
    moe.quantize_experts()
    for name, w in exact.items():
        step = getattr(moe, f"{name}_scales").float()
        assert ((moe.weight(name, torch.float32) - w).abs() <= step / 2 + 1e-7).all()


def test_quantized_decoding_runs_with_moe_and_keeps_the_greedy_tokens_close():
    from blockformer.generate import generate
    from blockformer.generate.quantize import Int8Linear, quantize

    cfg = TransformerConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, ffn_experts=4, experts_top_k=2,
                            shared_experts=1, init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    float_logits = model(tokens)
    quantize(model, "int8")
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    moe = model.decoder.blocks[0].ffn
    assert moe.w_up_int8.dtype == torch.int8 and moe.w_down_int8.shape == (4, cfg.expert_d_ff, 64)
    assert {n for n, _ in moe.named_parameters() if not n.startswith("shared")} == {"router", "b_up", "b_down"}
    q_logits = model(tokens)
    rel = (q_logits - float_logits).pow(2).mean().sqrt() / float_logits.pow(2).mean().sqrt()
    assert rel < 0.02, rel
    out = generate(model, [[1, 2, 3]], 8, do_sample=False)
    assert len(out[0]) == 8


def test_info_counts_total_and_active_parameters_and_flops():
    dense_cfg = TransformerConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, d_ff=64, bias=False)
    moe_cfg_ = TransformerConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, d_ff=64, bias=False,
                                 ffn_experts=8, experts_top_k=2, expert_d_ff=32)
    dense, moe = build_model(dense_cfg), build_model(moe_cfg_)
    experts = 8 * 2 * 32 * 32  # per layer: 8 experts of up + down, 32 x 32 each
    router = 8 * 32
    assert count_parameters(moe) - count_parameters(dense) == 2 * (experts + router - 2 * 32 * 64)
    # Active: 2 of 8 experts -> the dense FFN's size (2 x 32 = 64 wide), plus the router.
    assert active_parameters(moe, moe_cfg_) == count_parameters(dense) + 2 * router
    assert active_parameters(dense, dense_cfg) == count_parameters(dense)
    assert flops_per_token(moe_cfg_, 16) - flops_per_token(dense_cfg, 16) == 3 * 2 * 2 * router


def test_info_command_prints_active_parameters(capsys):
    from blockformer.cli import main

    code = main(["info", "--preset", "stdlib-lm", "--set", "model.ffn_experts=8", "--set", "model.experts_top_k=2",
                 "--json"])
    info = json.loads(capsys.readouterr().out)
    assert code == 0 and info["active_parameters"] < info["parameters"]


def test_config_rejects_top_k_above_the_expert_count():
    with pytest.raises(ValueError, match="experts_top_k"):
        TransformerConfig(ffn_experts=2, experts_top_k=3)
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        TransformerConfig(ffn_experts=2, expert_capacity_factor=-1.0)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_the_models_training_loss_includes_its_routers_aux_loss_per_target_token(arch):
    """The trainer adds nothing: ``model(..., targets=)`` in training is the task loss plus
    the routers' weighted aux loss times the (non-padding) targets; in eval, the task loss."""
    from blockformer.nn.loss import token_loss

    cfg = TransformerConfig(arch=arch, vocab_size=30, d_model=16, n_layers=2, n_heads=2, ffn_experts=4,
                            experts_top_k=2, router_aux_coef=0.5, router_z_coef=0.1)
    model = build_model(cfg, seed=0).train()
    tokens = torch.randint(1, 30, (2, 6))
    targets = tokens.roll(-1, 1)
    targets[1, 4:] = 0  # padding: not a target
    call = (lambda **kw: model(tokens, tokens, **kw)) if arch == "encoder-decoder" else (lambda **kw: model(tokens, **kw))
    torch.manual_seed(1)
    logits = call()
    expected = token_loss(logits, targets) + auxiliary_loss(model) * 10
    torch.manual_seed(1)
    torch.testing.assert_close(call(targets=targets), expected)
    model.eval()
    torch.testing.assert_close(call(targets=targets), token_loss(call(), targets))


def test_training_adds_the_aux_loss_and_logs_routing_stats(tmp_path):
    from blockformer.run_config import load_run_config
    from blockformer.train import train

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7}\n" for i in range(100)))
    cfg = load_run_config(overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32", "model.ffn_experts=4",
        "model.experts_top_k=2", "model.expert_capacity_factor=1.0", "model.max_seq_len=32",
        f"data.text={corpus}", "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32",
        "train.batch_size=4", "train.steps=4", "train.log_every=2", "train.eval_every=0", "train.progress=false",
    ])
    train(cfg, tmp_path / "run", log=lambda *a: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["split"] == "train"]
    assert len(logged) == 2
    for r in logged:
        assert len(r["expert_load"]) == 4 and sum(r["expert_load"]) == pytest.approx(1.0, abs=1e-3)
        assert 0.0 <= r["dropped"] < 1.0 and r["balance_loss"] >= 2.0 - 1e-4 and r["z_loss"] > 0
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert "router_aux_coef = 0.01" in saved and "router_z_coef = 0.001" in saved


def test_left_padded_cached_moe_row_matches_the_row_alone_and_padding_takes_no_capacity():
    cfg = TransformerConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, ffn_experts=4, experts_top_k=2,
                            init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(4, 37, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    real = torch.tensor([[False] * 3 + [True] * 5])
    positions = (real.cumsum(-1) - 1).clamp(min=0)
    cache = model.new_cache(1, 12)
    got = model(padded, positions=positions, attention_mask=real, cache=cache, cache_pos=torch.arange(8))
    assert int(model.decoder.blocks[0].ffn.stats["load"].sum()) == 5 * 2  # the 3 pads were routed nowhere
    torch.testing.assert_close(got[:, 3:], model(prompt), atol=1e-5, rtol=1e-5)


def test_encoder_decoder_cache_equals_the_full_forward_with_moe_blocks():
    cfg = TransformerConfig(arch="encoder-decoder", vocab_size=37, d_model=32, n_layers=2, n_heads=4,
                            ffn_experts=4, experts_top_k=2, shared_experts=1, init_std=0.1)
    model = build_model(cfg, seed=0).eval()
    src, tgt = torch.randint(0, 37, (2, 8)), torch.randint(0, 37, (2, 7))
    src_mask = torch.ones(2, 8, dtype=torch.bool)
    src_mask[1, 5:] = False
    full = model(src, tgt, src_mask=src_mask)
    memory = model.encode(src, src_mask)
    cache = model.new_cache(2, 10)
    steps = [model.decode(tgt[:, :1], memory, src_mask, cache=cache, cache_pos=torch.tensor([0]))]
    for t in range(1, 7):
        steps.append(model.decode(tgt[:, t : t + 1], None, cache=cache, cache_pos=torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_expert_weights_are_decayed_and_expert_biases_are_not():
    from blockformer.train.optim import param_groups

    model = build_model(TransformerConfig(vocab_size=30, d_model=16, n_layers=1, n_heads=2, ffn_experts=4), seed=0)
    moe = model.decoder.blocks[0].ffn
    decay, no_decay = ({id(p) for p in g["params"]} for g in param_groups(model, 0.1))
    assert {id(moe.w_up), id(moe.w_down), id(moe.router)} <= decay
    assert {id(moe.b_up), id(moe.b_down)} <= no_decay


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_inductor_compiled_moe_matches_eager_and_trains_the_router(precision):
    """fp32 under compile takes the padded dropless path (grouped_mm's compile check wants
    bf16); bf16 with a capacity factor takes the dropping path."""
    torch._dynamo.reset()
    cfg = TransformerConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, ffn_experts=4, experts_top_k=2,
                            expert_capacity_factor=1.25 if precision == "bf16" else 0.0)
    model = build_model(cfg, seed=0).train()
    compiled = torch.compile(model)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        got, want = compiled(tokens).float(), model(tokens).float()
    torch.testing.assert_close(got, want, atol=1e-5 if precision == "fp32" else 2e-2, rtol=1e-3)
    (got.sum() + auxiliary_loss(model)).backward()
    assert model.decoder.blocks[0].ffn.router.grad.abs().sum() > 0


@pytest.mark.slow
def test_compiled_bf16_int8_decoding_of_an_moe_model_keeps_the_float_greedy_tokens():
    from blockformer.generate import generate
    from blockformer.generate.quantize import prepare_for_decoding

    torch._dynamo.reset()
    cfg = TransformerConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, ffn_experts=4, experts_top_k=2,
                            init_std=0.1)
    want = generate(build_model(cfg, seed=0).eval(), [[1, 2, 3]], 12, do_sample=False)
    model = prepare_for_decoding(build_model(cfg, seed=0).eval(), "bf16", "int8")
    assert generate(model, [[1, 2, 3]], 12, do_sample=False, compile=True) == want


def test_a_task_heads_training_loss_includes_the_routers_aux_loss():
    """Classification over MoE blocks: the objective's loss is the head's loss plus the
    routers' aux loss per labelled example, in training only."""
    import types

    from blockformer.data.labelled import LabelledBatch
    from blockformer.models.heads import TaskModel, build_head
    from blockformer.train.classify import TaskHead, head_loss

    cfg = TransformerConfig(arch="encoder", vocab_size=30, d_model=16, n_layers=2, n_heads=2, ffn_experts=4,
                            experts_top_k=2, router_aux_coef=0.5)
    model = TaskModel(build_model(cfg, seed=0), build_head("classify", 16, 3, "cls", 0.0)).train()
    batch = LabelledBatch(torch.randint(4, 30, (4, 6)), torch.ones(4, 6, dtype=torch.bool), torch.tensor([0, 1, 2, 1]))
    objective = types.SimpleNamespace(task="classify", weights=None, count_targets=lambda b: 4)
    got = TaskHead.loss(objective, model, batch)
    plain = head_loss("classify", model(batch.tokens, attention_mask=batch.mask), batch.targets, None, 0.0)
    torch.testing.assert_close(got, plain + auxiliary_loss(model) * 4)
    model.eval()
    torch.testing.assert_close(TaskHead.loss(objective, model, batch),
                               head_loss("classify", model(batch.tokens, attention_mask=batch.mask), batch.targets, None, 0.0))
