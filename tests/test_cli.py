"""The command line: train/eval/info/generate end to end, and one-line errors with exit code 2."""

import json
import math
import re

import pytest
import torch

from blockformer import build_model, count_parameters
from blockformer.cli import main
from blockformer.run_config import load_run_config
from blockformer.tokenizers import CharTokenizer
from blockformer.train.load import load_checkpoint
from blockformer.generate import generate, speculative_generate
from blockformer.tokenizers import EOS_ID

def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


TINY = _sets("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
             "train.progress=false")


def _corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(200)))
    return corpus


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    args = ["train", *TINY, *_sets(
        f"data.text={_corpus(tmp)}", "data.tokenizer=char", f"data.cache_dir={tmp / 'cache'}",
        "data.seq_len=32", "model.max_seq_len=64", "train.batch_size=8", "train.steps=30",
        "train.eval_every=15", "train.lr=3e-3",
        "train.samples=1", "train.sample_tokens=20", "train.sample_prompts=def ",
    ), "--out", str(tmp / "run")]
    return tmp / "run", args


def test_train_reports_and_writes_a_run(lm_run, capsys):
    run_dir, args = lm_run
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"validation: val_loss \d+\.\d+  val_ppl", out)
    assert "samples" in out and "checkpoint: " + str(run_dir / "best") in out
    assert f"loss curve: {run_dir / 'loss.png'}" in out
    assert "blockformer generate --checkpoint" in out and "blockformer eval --checkpoint" in out
    assert (run_dir / "loss.png").is_file() and (run_dir / "best" / "model.safetensors").is_file()


def test_generate_is_deterministic_for_a_seed(lm_run, capsys):
    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    capsys.readouterr()
    cmd = ["generate", "--checkpoint", str(run_dir), "--prompt", "def f1", "--max-new-tokens", "25",
           "--seed", "7", "--temperature", "1.0", "--top-k", "10"]
    assert main(cmd) == 0
    first = capsys.readouterr().out
    assert main(cmd) == 0
    assert capsys.readouterr().out == first
    ckpt = load_checkpoint(run_dir)
    [ids] = generate(ckpt.model, [ckpt.tokenizer.encode("def f1")], 25, temperature=1.0, top_k=10,
                     eos_id=EOS_ID, generator=torch.Generator().manual_seed(7))
    assert first == "def f1" + ckpt.tokenizer.decode(ids) + "\n"
    assert 0 < len(ids) <= 25
    assert main([*cmd[:-6], "--seed", "8", "--temperature", "1.0", "--top-k", "10"]) == 0
    assert capsys.readouterr().out != first  # another seed, another sample


def test_generate_streams_and_stops_at_a_stop_string(lm_run, capsys):
    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    ckpt = load_checkpoint(run_dir)
    [ids] = generate(ckpt.model, [ckpt.tokenizer.encode("def f")], 40, temperature=0, eos_id=EOS_ID)
    full = ckpt.tokenizer.decode(ids)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "def f", "--max-new-tokens", "40",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "def f" + full + "\n"  # the streamed pieces add up to the text
    stop = full[3:5]  # a string the greedy text contains: output ends just before it
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "def f", "--max-new-tokens", "40",
                 "--temperature", "0", "--stop", stop]) == 0
    assert capsys.readouterr().out == "def f" + full[: full.index(stop)] + "\n"


def test_generate_keeps_its_cache_in_the_dtype_asked_for(lm_run, capsys):
    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    ckpt = load_checkpoint(run_dir)
    cmd = ["generate", "--checkpoint", str(run_dir), "--prompt", "def f", "--max-new-tokens", "30", "--temperature", "0"]
    capsys.readouterr()
    for dtype in ("bf16", "fp16", "int8"):
        [ids] = generate(ckpt.model, [ckpt.tokenizer.encode("def f")], 30, temperature=0, eos_id=EOS_ID,
                         kv_cache_dtype=dtype)
        assert main([*cmd, "--kv-cache-dtype", dtype]) == 0
        assert capsys.readouterr().out == "def f" + ckpt.tokenizer.decode(ids) + "\n"
    assert "--kv-cache-dtype: invalid choice: 'int4'" in _error(capsys, [*cmd, "--kv-cache-dtype", "int4"])
    out = speculative_generate(ckpt.model, ckpt.model, [ckpt.tokenizer.encode("def f")], 30, temperature=0,
                               eos_id=EOS_ID, kv_cache_dtype="bf16")  # its own draft: every proposal taken
    assert out.accepted == out.proposed > 0
    assert main([*cmd, "--kv-cache-dtype", "bf16", "--draft", str(run_dir)]) == 0
    assert capsys.readouterr().out == "def f" + ckpt.tokenizer.decode(out.tokens[0]) + "\n"
    assert "--draft: not combined with --min-new-tokens or --compile" in _error(capsys, [*cmd, "--compile", "--draft",
                                                                                      str(run_dir)])


def test_quantized_generate_keeps_the_float_models_greedy_tokens(tmp_path, capsys):
    """A random byte-level decoder (seed 0, init_std 0.2, so greedy choices vary), 20 greedy
    tokens through the CLI, compared as decoded text. Measured here: int8 gives the float
    model's text exactly, int4 (16 levels per group) its first 8 tokens, int4-a8 (the same
    weights, activations rounded to int8) the same text as int4, int8-a8 its first 15 characters;
    required: >= 90% of the characters equal by position for int8, the first 8 for int8-a8, the
    first 4 for int4 and int4-a8."""
    from blockformer.generate import generate as lib_generate
    from blockformer.tokenizers import train_tokenizer
    from blockformer.train.checkpoint import save_checkpoint

    cfg = load_run_config(overrides=["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=256",
                                     "model.vocab_size=260", "model.init_std=0.2", "model.tie_embeddings=false"])
    model = build_model(cfg.model, seed=0).eval()
    tok = train_tokenizer("byte", [])
    path = save_checkpoint(tmp_path / "ck", model, tok, cfg)
    [float_ids] = lib_generate(model, [tok.encode("def f")], 20, temperature=0)
    float_text = tok.decode(float_ids)
    assert len(set(float_ids)) >= 8  # a varied continuation, not one repeated token
    for scheme in ("int8", "int4", "int4-a8", "int8-a8"):
        assert main(["generate", "--checkpoint", str(path), "--prompt", "def f", "--max-new-tokens", "20",
                     "--temperature", "0", "--quantize", scheme, "--precision", "bf16"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("def f") and out.endswith("\n")
        text = out[len("def f"):-1]  # the streamed text is the decoded ids (bytes as UTF-8, invalid ones replaced)
        same = sum(a == b for a, b in zip(text, float_text)) / max(len(float_text), 1)
        if scheme == "int8":
            assert same >= 0.9, (text, float_text)
        elif scheme == "int8-a8":
            assert text[:8] == float_text[:8], (text, float_text)
        else:
            assert text[:4] == float_text[:4], (scheme, text, float_text)


def test_generate_with_a_draft_checkpoint_prints_plain_greedy_and_the_acceptance_rate(lm_run, capsys):
    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    draft = sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name != "best")[0]  # an earlier step
    cmd = ["generate", "--checkpoint", str(run_dir), "--prompt", "def f", "--max-new-tokens", "30",
           "--temperature", "0"]
    capsys.readouterr()
    assert main(cmd) == 0
    plain = capsys.readouterr().out
    assert main([*cmd, "--draft", str(draft), "--num-draft", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    rate = re.search(r"speculative: (\d+)/(\d+) drafted tokens accepted", err)
    assert rate and 0 < int(rate.group(2)) and int(rate.group(1)) <= int(rate.group(2))
    assert main([*cmd, "--draft", str(draft), "--num-draft", "0"]) == 2


def test_generate_streams_the_weights_of_its_one_row_steps_and_packs_a_speculative_checks(lm_run, capsys, monkeypatch):
    """On a CPU that packs fp32 (AVX-512, no AMX): the one prompt's one-row steps stream the weights
    instead, as does a draft; a target that checks 4 drafts (5 rows a step) packs, one that checks 3 streams."""
    import blockformer.generate as generate_package
    from blockformer import kernels
    from blockformer.generate import PackedLinear, packed
    from blockformer.generate.packed import StreamedLinear

    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    monkeypatch.setattr(packed, "can_pack", lambda dtype: True)
    monkeypatch.setattr(kernels, "cpu_has", lambda probe: False)
    prepared, real = [], generate_package.prepare_for_decoding
    monkeypatch.setattr(generate_package, "prepare_for_decoding",
                        lambda model, *a, **kw: prepared.append(real(model, *a, **kw)) or prepared[-1])

    def kinds(model):
        return {type(m).__name__ for m in model.modules() if isinstance(m, (PackedLinear, StreamedLinear))}

    cmd = ["generate", "--checkpoint", str(run_dir), "--prompt", "def f", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(cmd) == 0
    plain = capsys.readouterr().out
    assert [kinds(m) for m in prepared] == [{"StreamedLinear"}]
    prepared.clear()
    assert main([*cmd, "--draft", str(run_dir), "--num-draft", "4"]) == 0
    assert capsys.readouterr().out == plain
    assert [kinds(m) for m in prepared] == [{"PackedLinear"}, {"StreamedLinear"}]  # the target, then the draft
    prepared.clear()
    assert main([*cmd, "--draft", str(run_dir), "--num-draft", "3"]) == 0
    assert capsys.readouterr().out == plain
    assert [kinds(m) for m in prepared] == [{"StreamedLinear"}, {"StreamedLinear"}]


def test_eval_prints_loss_and_perplexity(lm_run, capsys):
    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    capsys.readouterr()
    text = load_checkpoint(run_dir).config.data.text
    assert main(["eval", "--checkpoint", str(run_dir), "--json", "--batches", "2"]) == 2  # reads no file unasked
    assert f"--data {text}" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run_dir), "--data", text, "--json", "--batches", "2"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]))
    assert 0 < metrics["val_loss"] < math.log(load_checkpoint(run_dir).tokenizer.vocab_size)


def test_info_preset_counts_the_parameters_of_the_built_model(capsys):
    assert main(["info", "--preset", "char-lm-tiny"]) == 0
    out = capsys.readouterr().out
    cfg = load_run_config(preset="char-lm-tiny")
    expected = count_parameters(build_model(cfg.model))
    assert f"parameters   {expected:,} " in out
    assert main(["info", "--preset", "copy", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == count_parameters(build_model(load_run_config(preset="copy").model))
    assert info["flops_per_token"] > 6 * info["parameters_without_embeddings"] * 0.9


def test_info_on_a_checkpoint(lm_run, capsys):
    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    capsys.readouterr()
    assert main(["info", "--checkpoint", str(run_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == count_parameters(load_checkpoint(run_dir).model)


@pytest.mark.parametrize("command", ["train", "eval", "info", "generate"])
def test_every_command_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "usage: blockformer " + command in capsys.readouterr().out


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_config_typo_names_the_key_and_the_closest_valid_one(capsys, tmp_path):
    err = _error(capsys, ["train", "--preset", "copy", "--set", "train.lerning_rate=1"])
    assert "train.lerning_rate: unknown key" in err
    path = tmp_path / "run.toml"
    path.write_text("[model]\nn_layer = 2\n")
    err = _error(capsys, ["train", str(path)])
    assert "model.n_layer: unknown key (did you mean 'n_layers'?)" in err


def test_usage_errors_are_one_line_with_exit_code_2(capsys, tmp_path):
    assert "expected int" in _error(capsys, ["train", "--set", "train.steps=ten"])
    assert "config file not found" in _error(capsys, ["train", str(tmp_path / "nope.toml")])
    (tmp_path / "empty.toml").write_text("")
    assert "empty.toml: config file is empty" in _error(capsys, ["train", str(tmp_path / "empty.toml")])
    assert "unknown preset (did you mean 'stdlib-lm'?)" in _error(capsys, ["train", "--preset", "stdlib_lm"])
    assert "unknown preset" in _error(capsys, ["info", "--preset", "gpt-5"])
    missing = tmp_path / "missing.txt"
    err = _error(capsys, ["train", *TINY, "--set", f"data.text={missing}", "--out", str(tmp_path / "r")])
    assert str(missing) in err
    (tmp_path / "empty.txt").write_text("")
    empty = _sets(f"data.text={tmp_path / 'empty.txt'}", "data.tokenizer=char")
    err = _error(capsys, ["train", *TINY, *empty, "--out", str(tmp_path / "r")])
    assert "empty.txt" in err
    err = _error(capsys, ["eval", "--checkpoint", str(tmp_path / "none")])
    assert "checkpoint directory not found" in err
    assert "--resume: the run config comes from the checkpoint" in _error(
        capsys, ["train", "--preset", "copy", "--resume", str(tmp_path)])


def test_a_tokenizer_that_does_not_match_the_checkpoint(lm_run, capsys, tmp_path):
    import shutil

    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_dir / "best", ckpt)
    CharTokenizer("abc").save(ckpt)
    err = _error(capsys, ["generate", "--checkpoint", str(ckpt), "--prompt", "x"])
    assert "tokenizer.json: tokenizer has 7 tokens but the model expects" in err
    err = _error(capsys, ["train", "--resume", str(ckpt), "--set", "train.steps=40"])
    assert "tokenizer.json" in err


def test_resume_from_the_command_line_trains_on(lm_run, capsys, tmp_path):
    import shutil

    run_dir, args = lm_run
    if not (run_dir / "best").exists():
        main(args)
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    capsys.readouterr()
    assert main(["train", "--resume", str(copy), "--set", "train.steps=36", "--set", "train.samples=0"]) == 0
    out = capsys.readouterr().out
    assert "validation: val_loss" in out
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "val"] == [15, 30, 36]
    assert (copy / "step-000036" / "trainer_state.pt").is_file()
    assert load_checkpoint(copy / "step-000036").config.train.steps == 36
