"""LoRA: exact at B = 0, merge/unmerge to 1e-5, a small adapter file naming its base, a few
percent of the parameters trained, and a merged model that decodes like any other."""

import json
import math

import pytest
import safetensors
import torch
from torch import nn

from blockformer.config import TransformerConfig
from blockformer.generate import generate, greedy_decode, quantize
from blockformer.models import build_model
from blockformer.models.heads import SequenceHead, TaskModel
from blockformer.nn.lora import LoRALinear, apply_lora, low_rank_product, merge_lora, unload_lora, unmerge_lora
from blockformer.run_config import LoraConfig, RunConfig, load_run_config
from blockformer.stats import count_parameters
from blockformer.tokenizers import train_tokenizer
from blockformer.train import train
from blockformer.train.checkpoint import WEIGHTS, save_checkpoint
from blockformer.train.adapter import ADAPTER, read_adapter_base
from blockformer.train.load import load_checkpoint

QUIET = dict(log=lambda *a: None)
ALL = ["qkv", "out", "up", "gate", "down"]


def _randomise_b(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                for b in m.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.05)


@pytest.mark.parametrize("arch,ffn", [("decoder", "swiglu"), ("encoder", "gelu"), ("encoder-decoder", "geglu")])
def test_adapters_with_b_zero_leave_the_model_exactly_as_it_was(arch, ffn):
    cfg = TransformerConfig(arch=arch, vocab_size=40, d_model=32, n_layers=2, n_heads=4, ffn=ffn)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    args = (tokens, tokens) if arch == "encoder-decoder" else (tokens,)
    before = model(*args)
    targets = ALL if ffn != "gelu" else ["qkv", "out", "up", "down"]
    n = apply_lora(model, LoraConfig(rank=4, targets=targets))
    # qkv, out, up (gate shares it), down per block; cross-attention adds q, kv and out
    assert n == cfg.total_layers * 4 + (cfg.n_decoder_layers * 3 if arch == "encoder-decoder" else 0)
    assert torch.equal(model(*args), before)


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_equals_unmerged_and_unmerge_restores_the_base(rslora):
    cfg = TransformerConfig(arch="decoder", vocab_size=40, d_model=32, n_layers=2, n_heads=4, ffn="swiglu")
    model = build_model(cfg, seed=0).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoraConfig(rank=4, alpha=8, rslora=rslora, targets=ALL))
    layer = model.decoder.blocks[0].attn.qkv
    assert layer.scale == pytest.approx(8 / math.sqrt(4) if rslora else 8 / 4)
    _randomise_b(model)
    tokens = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    adapted = model(tokens)
    assert not torch.allclose(adapted, build_model(cfg, seed=0).eval()(tokens), atol=1e-3)  # the adapters act
    merge_lora(model)
    torch.testing.assert_close(model(tokens), adapted, atol=1e-5, rtol=0)
    unmerge_lora(model)
    for k, v in base.items():
        torch.testing.assert_close(model.state_dict()[k], v, atol=1e-6, rtol=0)
    torch.testing.assert_close(model(tokens), adapted, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rank", [2, 8])
def test_the_low_rank_update_rounds_each_element_alike_in_any_block_of_rows_or_columns(rank):
    # Merged weights are hashed, and composed a few rows at a time on one rank and whole on another:
    # each element must be the same sum, rounded the same way, whatever the block (a BLAS matmul is not:
    # MKL on an AMD EPYC rounds 1-3 rows otherwise than the whole matrix).
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(97, rank, generator=g), torch.randn(rank, 300, generator=g)
    whole = low_rank_product(b, a)
    expected = b[:, :1].numpy() * a[:1].numpy()  # numpy's own float32 ops, the rank in order, each rounded once
    for k in range(1, rank):
        expected = expected + b[:, k:k + 1].numpy() * a[k:k + 1].numpy()
    assert torch.equal(whole, torch.from_numpy(expected))
    for rows in (1, 2, 3, 7, 64):
        assert torch.equal(torch.cat([low_rank_product(b[i:i + rows], a) for i in range(0, 97, rows)]), whole), rows
    assert torch.equal(low_rank_product(b, a[:, 5:17]), whole[:, 5:17])
    torch.testing.assert_close(low_rank_product(b.bfloat16(), a.bfloat16()), (b.bfloat16().float() @ a.bfloat16().float()),
                               atol=1e-5, rtol=1e-5)  # bf16 factors: multiplied and summed in fp32


def test_gate_and_up_adapt_their_own_halves_of_the_fused_matrix():
    cfg = TransformerConfig(arch="decoder", vocab_size=40, d_model=32, n_layers=1, n_heads=4, ffn="swiglu")
    model = build_model(cfg, seed=0)
    apply_lora(model, LoraConfig(rank=2, targets=["gate"]))
    up = model.decoder.blocks[0].ffn.up
    _randomise_b(model)
    w0 = up.weight.detach().clone()
    up.merge()
    changed = (up.weight.detach() != w0).any(dim=1)
    assert changed[: cfg.d_ff].all() and not changed[cfg.d_ff :].any()


def test_gate_on_an_ungated_ffn_is_an_error():
    model = build_model(TransformerConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=4), seed=0)
    with pytest.raises(ValueError, match="'gate' needs a gated FFN"):
        apply_lora(model, LoraConfig(rank=2, targets=["gate"]))


# ---------------------------------------------------------------------- LoRA runs
def _corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(200)))
    return corpus


def _base_checkpoint(tmp_path, arch="decoder", **model):
    """An (untrained) base checkpoint: fine-tuning only needs weights to start from."""
    overrides = [f"model.arch={arch}", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                 "model.max_seq_len=32", "model.vocab_size=260", "model.ffn=swiglu", "model.d_ff=128",
                 f"data.text={_corpus(tmp_path)}", "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_run_config(overrides=overrides + [f"model.{k}={v}" for k, v in model.items()])
    return save_checkpoint(tmp_path / f"base-{arch}", build_model(cfg.model, seed=0), train_tokenizer("byte", []), cfg)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base = _base_checkpoint(tmp)
    cfg = load_run_config(overrides=[
        "model.arch=decoder", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
        "model.ffn=swiglu", "model.d_ff=128", f"data.text={_corpus(tmp)}", "data.seq_len=32", f"data.cache_dir={tmp / 'cache'}",
        f"train.init_from={base}", "lora.rank=2", "lora.targets=qkv,out", "train.steps=30", "train.eval_every=0",
        "train.lr=1e-2", "train.batch_size=8", "train.progress=false"])
    result = train(cfg, tmp / "run", **QUIET)
    return base, result


def test_a_lora_run_trains_a_few_percent_and_saves_only_the_adapter(lora_run):
    base, result = lora_run
    ckpt_dir = result.checkpoint
    assert not (ckpt_dir / WEIGHTS).exists()
    with safetensors.safe_open(str(ckpt_dir / ADAPTER), framework="pt") as f:
        names = list(f.keys())
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), [n for n in names if "lora" not in n]
    assert read_adapter_base(ckpt_dir) == str(base.resolve())
    config = json.loads((ckpt_dir / "config.json").read_text())
    assert config["lora"]["rank"] == 2
    n_adapter = sum(t.numel() for t in safetensors.torch.load_file(str(ckpt_dir / ADAPTER)).values())
    n_total = count_parameters(load_checkpoint(ckpt_dir).model)
    assert n_adapter / n_total < 0.03  # 2 layers x (qkv + out) at rank 2
    assert (ckpt_dir / ADAPTER).stat().st_size < 0.1 * (base / WEIGHTS).stat().st_size
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 0.2, result.losses[::5]  # the adapters learn


def test_the_base_is_untouched_and_the_merged_checkpoint_is_a_plain_model(lora_run):
    base, result = lora_run
    base_model = load_checkpoint(base).model
    merged = load_checkpoint(result.checkpoint).model
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    same = {k for k, v in merged.state_dict().items() if torch.equal(v, base_model.state_dict()[k])}
    changed = set(merged.state_dict()) - same
    assert changed and all(k.endswith(("attn.qkv.weight", "attn.out.weight")) for k in changed), changed


def test_a_merged_lora_decoder_generates_with_the_cache_and_quantized(lora_run):
    _, result = lora_run
    model = load_checkpoint(result.checkpoint).model
    prompt = [[5, 6, 7, 8]]
    with_cache = generate(model, prompt, 12, temperature=0)
    assert with_cache == generate(model, prompt, 12, temperature=0, use_cache=False)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    ref = model(tokens)
    for scheme, tol in (("int8", 0.05), ("int4", 0.5)):
        q = quantize(load_checkpoint(result.checkpoint).model, scheme, group_size=32)
        assert (q(tokens) - ref).abs().max().item() < tol
        assert len(generate(q, prompt, 5, temperature=0)[0]) == 5


def test_a_merged_lora_encoder_decoder_translates_greedily():
    cfg = TransformerConfig(arch="encoder-decoder", vocab_size=40, d_model=32, n_layers=1, n_heads=4, max_seq_len=32)
    model = build_model(cfg, seed=0).eval()
    apply_lora(model, LoraConfig(rank=2, targets=["qkv", "out", "up", "down"]))
    _randomise_b(model)
    src = [[5, 6, 7], [8, 9]]
    adapted = greedy_decode(model, src, max_len=8, use_cache=False)
    unload_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert greedy_decode(model, src, max_len=8) == adapted


def test_lora_without_a_base_checkpoint_is_a_usage_error(tmp_path):
    from blockformer.errors import UsageError

    cfg = load_run_config(overrides=[f"data.text={_corpus(tmp_path)}", "lora.rank=2", "train.progress=false",
                                     "model.d_model=32", "model.n_heads=2", "model.n_layers=1",
                                     f"data.cache_dir={tmp_path / 'c'}", "data.seq_len=32"])
    with pytest.raises(UsageError, match="train.init_from"):
        train(cfg, tmp_path / "run", **QUIET)
