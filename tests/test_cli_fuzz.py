"""CLI fuzz: bad invocations of every command, each run in-process. Every one must exit
with code 2 and exactly one line on stderr, never a traceback, and must fail before any
long work (each case takes well under a second)."""

import json

import pytest
import torch

from blockformer import build_model
from blockformer.cli import main
from blockformer.run_config import load_run_config
from blockformer.tokenizers import CharTokenizer, train_tokenizer
from blockformer.train.checkpoint import save_checkpoint

S = "--set"
CASES = [
    # command line itself
    ["trian"],
    ["--bogus"],
    ["train", "--bogus"],
    ["train", "--preset"],
    # config values and keys
    ["train", S, "train.lerning_rate=1e-3"],
    ["train", S, "train.lr=inf"],
    ["train", S, "train.lr=nan"],
    ["train", S, "train.lr=0"],
    ["train", S, "train.lr=-1"],
    ["train", S, "train.steps=0"],
    ["train", S, "train.steps=-5"],
    ["train", S, "train.steps=99999999999999999999999"],
    ["train", S, "train.batch_size=0"],
    ["train", S, "train.nonfinite=maybe"],
    ["train", S, "train.max_minutes=-1"],
    ["train", S, "train.max_minutes=inf"],
    ["train", S, "model.d_model=abc"],
    ["train", S, "model.dropout=nan"],
    ["train", S, "model.position=absolute"],
    ["train", S, "model.d_model=99999999999999999999"],
    ["train", S, "nonsense"],
    ["train", S, "foo.bar=1"],
    ["train", S, "data.val_fraction=1.5"],
    ["train", S, "data.text="],
    ["train", "--preset", "nope"],
    ["train", "{missing}.toml"],
    ["train", "{bad_utf8}"],
    ["train", "{bad_toml}"],
    ["train", "{empty_toml}"],
    ["train", "{typo_toml}"],
    # run directories
    ["train", "--resume", "{missing}"],
    ["train", "--resume", "{dec}", "--preset", "copy"],
    ["train", "--preset", "copy", "--out", "{file}"],
    ["train", "--preset", "copy", "--out", "{file}/run"],
    ["train", "--preset", "copy", "--out", "{used_run}"],
    ["train", "--resume", "{dec}", "--overwrite"],
    # fine-tuning: masked LM, task heads, init-from, LoRA, predict
    ["train", S, "train.mask_rate=1.5"],
    ["train", S, "train.objective=mlm"],
    ["train", S, "head.task=classify"],
    ["train", S, "lora.targets=qkv,attn"],
    ["train", S, "lora.rank=4", S, "data.text={src}"],
    ["train", "--init-from", "{missing}"],
    ["train", "--init-from", "{dec}", "--resume", "{dec}"],
    ["train", "--init-from", "{dec}", S, "data.labels={src}", S, "head.task=classify"],
    ["predict", "--checkpoint", "{dec}", "--input", "{src}"],
    ["predict", "--checkpoint", "{missing}", "--input", "{src}"],
    # generate
    ["generate"],
    ["generate", "--checkpoint", "{missing}"],
    ["generate", "--checkpoint", "{file}"],
    ["generate", "--checkpoint", "{ed}"],
    ["generate", "--checkpoint", "{dec}", "--temperature", "nan"],
    ["generate", "--checkpoint", "{dec}", "--temperature", "-1"],
    ["generate", "--checkpoint", "{dec}", "--temperature", "inf"],
    ["generate", "--checkpoint", "{dec}", "--num-samples", "0"],
    ["generate", "--checkpoint", "{dec}", "--num-samples", "-1"],
    ["generate", "--checkpoint", "{dec}", "--max-new-tokens", "0"],
    ["generate", "--checkpoint", "{dec}", "--max-new-tokens", "99999999999999999"],
    ["generate", "--checkpoint", "{dec}", "--max-new-tokens", "abc"],
    ["generate", "--checkpoint", "{dec}", "--min-new-tokens", "5", "--max-new-tokens", "2"],
    ["generate", "--checkpoint", "{dec}", "--top-k", "0"],
    ["generate", "--checkpoint", "{dec}", "--top-p", "0"],
    ["generate", "--checkpoint", "{dec}", "--top-p", "nan"],
    ["generate", "--checkpoint", "{dec}", "--seed", "-1"],
    ["generate", "--checkpoint", "{dec}", "--device", "tpu"],
    ["generate", "--checkpoint", "{dec}", "--precision", "fp16"],
    ["generate", "--checkpoint", "{dec}", "--device", "cuda"] if not torch.cuda.is_available() else ["generate"],
    # translate
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--beam", "0"],
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--beam", "100000"],
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--alpha", "nan"],
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--batch-size", "0"],
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--n-best", "5", "--beam", "2"],
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--max-len-a", "nan"],
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--output", "{dir}"],
    ["translate", "--checkpoint", "{ed}", "--input", "{src}", "--output", "{missing}/out.txt"],
    ["translate", "--checkpoint", "{ed}", "--input", "{missing}"],
    ["translate", "--checkpoint", "{dec}", "--input", "{src}"],
    # eval
    ["eval", "--checkpoint", "{dec}"],
    ["eval", "--checkpoint", "{dec}", "--batches", "-1"],
    ["eval", "--checkpoint", "{dec}", "--batch-size", "0"],
    ["eval", "--checkpoint", "{dec}", "--data", "{missing}"],
    ["eval", "--checkpoint", "{ed}", "--ref", "{src}"],
    ["eval", "--checkpoint", "{ed}", "--src", "{src}", "--ref", "{missing}"],
    ["eval", "--checkpoint", "{ed}", "--src", "{src}", "--ref", "{src}", "--hyp-output", "{dir}"],
    ["eval", "--checkpoint", "{ed}", "--src", "{src}", "--ref", "{src}", "--batch-size", "0"],
    ["eval", "--checkpoint", "{broken_tok}"],
    # info
    ["info"],
    ["info", "--preset", "nope"],
    ["info", "--preset", "copy", "--batch-size", "0"],
    ["info", "--preset", "copy", "--seq-len", "-1"],
    ["info", "--checkpoint", "{dec}", S, "model.d_model=8"],
    ["info", "--preset", "copy", S, "model.n_heads=3"],
    ["info", "--checkpoint", "{bad_json}"],
    # average
    ["average", "--output", "{dir}/avg"],
    ["average", "--run", "{dir}", "--last", "0", "--output", "{dir}/avg"],
    ["average", "--checkpoints", "{dec}", "--output", "{file}"],
    ["average", "--checkpoints", "{dec}", "--output", "{dec}"],
    ["average", "--checkpoints", "{dec}", "{ed}", "--output", "{dir}/avg"],
    ["average", "--checkpoints", "{dec}", "--output", "{used_run}"],
    # convert
    ["convert", "--out", "{dir}/hf"],
    ["convert", "--from-hf", "{dec}", "--to-hf", "{dec}", "--out", "{dir}/hf"],
    ["convert", "--from-hf", "{missing}", "--out", "{dir}/ckpt"],
    ["convert", "--from-hf", "{bad_json}", "--out", "{dir}/ckpt"],
    ["convert", "--from-hf", "{dec}", "--out", "{dir}/ckpt"],
    ["convert", "--to-hf", "{missing}", "--out", "{dir}/hf"],
    ["convert", "--to-hf", "{dec}", "--out", "{dir}/hf"],
    ["convert", "--to-hf", "{dec}", "--out", "{dir}/hf", "--tokenizer", "{file}"],
    # probes
    ["probe"],
    ["probe", "nope"],
    ["probe", "equivariance", "--batch-size", "0"],
    ["probe", "equivariance", "--seq-len", "-1"],
    ["probe", "equivariance", "--seed", "-5"],
    ["probe", "equivariance", "--init-std", "nan"],
    ["probe", "equivariance", "--plot", "{dir}"],
    ["probe", "equivariance", "--plot", "{missing}/p.png"],
    ["probe", "depth", "--steps", "-1"],
    ["probe", "depth", "--lr", "0"],
    ["probe", "gradients", "--depths", "8,x"],
    ["probe", "cost", "--device", "cuda"] if not torch.cuda.is_available() else ["probe", "cost", "--device", "tpu"],
    ["probe", "attention", "--checkpoint", "{missing}"],
    ["probe", "length", "--steps", "0"],
    ["probe", "length", "--schemes", "rope,absolute"],
    ["probe", "length", "--factors", "1,x"],
    # scaling sweeps
    ["sweep", "--sizes", "64"],
    ["sweep", "--tokens", "lots"],
    ["sweep", "--preset", "copy"],
    ["sweep", "--bootstrap", "-1"],
    ["sweep", "--fit-only"],
    ["sweep", "--holdout", "64:1M"],
    ["sweep", "--holdout", "64x2"],
    ["sweep", "--budget", "-1"],
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    small = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32"]
    byte = train_tokenizer("byte", [])
    text = tmp / "corpus.txt"
    text.write_text("hello world\n" * 20)
    cfg = load_run_config(overrides=[*small, "model.vocab_size=260", f"data.text={text}"])
    dec = save_checkpoint(tmp / "dec", build_model(cfg.model, seed=0), byte, cfg)
    tok = CharTokenizer("abcdefghij")
    ecfg = load_run_config(preset="reverse", overrides=[*small, f"model.vocab_size={tok.vocab_size}"])
    ed = save_checkpoint(tmp / "ed", build_model(ecfg.model, seed=0), tok, ecfg)
    broken = save_checkpoint(tmp / "broken_tok", build_model(cfg.model, seed=0), byte, cfg)
    cj = json.loads((broken / "config.json").read_text())
    cj["tokenizer"] = "x"  # malformed: not an object
    (broken / "config.json").write_text(json.dumps(cj))
    bad_json = tmp / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    (tmp / "file").write_text("x")
    (tmp / "dir").mkdir()
    (tmp / "src.txt").write_text("abc\ncba\n")
    (tmp / "bad_utf8.toml").write_bytes(b"[train]\nname = '\xff'\n")
    (tmp / "bad_toml.toml").write_text("[train\nsteps = 3\n")
    (tmp / "empty.toml").write_text("\n")
    (tmp / "typo.toml").write_text("[train]\nlerning_rate = 0.1\n")
    used = tmp / "used_run"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    return {"missing": str(tmp / "missing"), "dec": str(dec), "ed": str(ed), "file": str(tmp / "file"),
            "dir": str(tmp / "dir"), "src": str(tmp / "src.txt"), "bad_utf8": str(tmp / "bad_utf8.toml"),
            "bad_toml": str(tmp / "bad_toml.toml"), "empty_toml": str(tmp / "empty.toml"),
            "typo_toml": str(tmp / "typo.toml"), "used_run": str(used), "broken_tok": str(broken),
            "bad_json": str(bad_json)}


def test_the_table_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c)[:60] for c in CASES])
def test_a_bad_invocation_exits_2_with_one_line_and_no_traceback(argv, paths, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # anything a case creates (runs/...) lands here
    monkeypatch.delenv("BLOCKFORMER_DEBUG", raising=False)
    args = [a.format(**paths) for a in argv]
    code = main(args)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (code, err, captured.out[-500:])
    assert err.count("\n") == 1 and err.startswith("blockformer"), err
    assert "Traceback" not in err and "error" in err, err
