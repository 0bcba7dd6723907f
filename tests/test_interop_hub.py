"""Names people type, sharded exports and the model card: a tiny random GPT-2 in a temporary
Hugging Face cache loads by name with the network cut (any connection attempt fails the
test); a sharded export has the index transformers writes, loads in transformers with
blockformer's logits and reads back; every export carries a model card the Hub parses."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `test` extra installs it
huggingface_hub = pytest.importorskip("huggingface_hub")

from safetensors import safe_open  # noqa: E402
from test_interop_hf import DECODERS, _randomize, ours, save_hf, theirs_logits  # noqa: E402

import blockformer  # noqa: E402
from blockformer.cli import main  # noqa: E402
from blockformer.errors import UsageError  # noqa: E402
from blockformer.interop import from_hf, to_hf  # noqa: E402
from blockformer.interop.hf_dir import SAFETENSORS, SAFETENSORS_INDEX, parse_size  # noqa: E402
from blockformer.interop.hub import model_card  # noqa: E402

ATOL = 1e-5
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
IDS = torch.tensor([[12, 20, 31, 47, 13, 40, 22], [15, 15, 30, 44, 12, 19, 33]])


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 (huggingface_hub has read it at import, so the guard is the sockets):
    every connection refused, so a network attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] or args}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)


def gpt2_dir(directory: Path, seed: int = 1) -> Path:
    hf = _randomize(DECODERS["gpt2"]())
    if seed != 1:  # other weights, so a test can tell which copy was read
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return save_hf(hf, directory)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"a": gpt2_dir(root / "a"), "b": gpt2_dir(root / "b", seed=2)}


def cache_model(cache: Path, repo: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """``source`` as huggingface_hub caches a download: files in ``blobs/<sha256>``, linked from
    ``snapshots/<commit>/``, and ``refs/<name>`` holding the commit."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def logits(imported) -> torch.Tensor:
    """The logits in Hugging Face id order, comparable across imports and with transformers."""
    with torch.no_grad():
        return theirs_logits(imported, imported.model(ours(imported, IDS)))


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-org/tiny-gpt2"])
def test_a_cached_name_loads_offline_with_the_logits_of_its_directory(name, hf_dirs, tmp_path, monkeypatch, offline):
    cache = tmp_path / "cache"
    cache_model(cache, name, hf_dirs["a"], COMMIT_A)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    imported = from_hf(name)
    assert imported.family == "gpt2"
    torch.testing.assert_close(logits(imported), logits(from_hf(hf_dirs["a"])), atol=0, rtol=0)


def test_hf_home_hub_is_the_cache_when_hf_hub_cache_is_unset(hf_dirs, tmp_path, monkeypatch, offline):
    cache_model(tmp_path / "home" / "hub", "org/tiny", hf_dirs["a"], COMMIT_A)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    torch.testing.assert_close(logits(from_hf("org/tiny")), logits(from_hf(hf_dirs["a"])), atol=0, rtol=0)


def test_a_revision_or_a_commit_hash_picks_its_snapshot(hf_dirs, tmp_path, monkeypatch, offline):
    cache = tmp_path / "cache"
    cache_model(cache, "org/tiny", hf_dirs["a"], COMMIT_A)
    cache_model(cache, "org/tiny", hf_dirs["b"], COMMIT_B, refs=("v2",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    a, b = logits(from_hf(hf_dirs["a"])), logits(from_hf(hf_dirs["b"]))
    assert (a - b).abs().max() > 1e-2  # the two snapshots are told apart
    torch.testing.assert_close(logits(from_hf("org/tiny")), a, atol=0, rtol=0)
    torch.testing.assert_close(logits(from_hf("org/tiny@v2")), b, atol=0, rtol=0)
    torch.testing.assert_close(logits(from_hf(f"org/tiny@{COMMIT_B}")), b, atol=0, rtol=0)


def test_an_uncached_name_is_one_line_naming_it_and_the_cache(hf_dirs, tmp_path, monkeypatch, offline, capsys):
    cache = tmp_path / "cache"
    cache_model(cache, "org/tiny", hf_dirs["a"], COMMIT_A)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name, words in (("org/absent", "not in"), ("org/tiny@v9", "revision 'v9'")):
        with pytest.raises(UsageError) as e:
            from_hf(name)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{name}:")
        assert str(cache) in message and words in message and "expected a local Hugging Face model directory" in message
    assert main(["convert", "--from-hf", "org/absent", "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "org/absent" in err and str(cache) in err
    assert not (tmp_path / "ckpt").exists()


def test_a_local_directory_wins_over_a_cached_name(hf_dirs, tmp_path, monkeypatch, offline):
    cache = tmp_path / "cache"
    cache_model(cache, "org/tiny", hf_dirs["a"], COMMIT_A)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    shutil.copytree(hf_dirs["b"], tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    torch.testing.assert_close(logits(from_hf("org/tiny")), logits(from_hf(hf_dirs["b"])), atol=0, rtol=0)


# ---------------------------------------------------------------------- sharded export
def shard_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("model*.safetensors"))


def test_a_sharded_export_has_transformers_index_and_loads_with_equal_logits(hf_dirs, tmp_path, offline):
    imported = from_hf(hf_dirs["a"])
    out = to_hf(imported.model, tmp_path / "out", tokenizer=imported.tokenizer, max_shard_size="20KB")
    files = shard_files(out)
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / SAFETENSORS).exists()
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    held, size = {}, 0
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert shard_bytes <= 20_000 or len(tensors) == 1  # a tensor bigger than a shard gets its own
        held.update(dict.fromkeys(tensors, file))
        size += shard_bytes
    assert index["weight_map"] == held
    assert index["metadata"]["total_size"] == size
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, logits(imported), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits(from_hf(out)), logits(imported), atol=ATOL, rtol=0)


def test_an_export_below_the_default_shard_size_is_one_file(hf_dirs, tmp_path):
    imported = from_hf(hf_dirs["a"])
    out = to_hf(imported.model, tmp_path / "out", tokenizer=imported.tokenizer)
    assert shard_files(out) == [SAFETENSORS] and not (out / SAFETENSORS_INDEX).exists()


@pytest.mark.parametrize("value, expected", [("500MB", 500 * 10**6), ("2GB", 2 * 10**9), ("1GiB", 2**30),
                                             ("1.5kb", 1500), (4096, 4096), ("4096", 4096)])
def test_a_shard_size_reads_as_transformers_reads_it(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["5 parsecs", "0", -1, "1.5", "GB", True, [1]])
def test_a_bad_shard_size_is_one_line_naming_the_flag(value, hf_dirs, tmp_path):
    with pytest.raises(UsageError, match=r"^max_shard_size .*expected a positive size"):
        to_hf(from_hf(hf_dirs["a"]).model, tmp_path / "out", max_shard_size=value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- command line
def test_the_cli_imports_a_cached_name_and_exports_sharded(hf_dirs, tmp_path, monkeypatch, offline, capsys):
    cache = tmp_path / "cache"
    cache_model(cache, "org/tiny", hf_dirs["a"], COMMIT_A)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    assert main(["convert", "--from-hf", "org/tiny", "--out", str(ckpt)]) == 0
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(out), "--max-shard-size", "20KB"]) == 0
    assert len(shard_files(out)) >= 3 and (out / SAFETENSORS_INDEX).is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, logits(from_hf(hf_dirs["a"])), atol=ATOL, rtol=0)
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "x"), "--max-shard-size", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--max-shard-size 'lots'" in err and not (tmp_path / "x").exists()
    assert main(["convert", "--from-hf", "org/tiny", "--out", str(tmp_path / "y"), "--max-shard-size", "1GB"]) == 2
    assert "--max-shard-size: only with --to-hf" in capsys.readouterr().err


# ---------------------------------------------------------------------- model card
def test_every_export_carries_a_model_card_the_hub_reads(hf_dirs, tmp_path):
    imported = from_hf(hf_dirs["a"])
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(hf_dirs["a"]), "--out", str(ckpt)]) == 0
    out = to_hf(ckpt, tmp_path / "out")
    card = huggingface_hub.ModelCard((out / "README.md").read_text())
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.tags[0] == "blockformer" and "gpt2" in card.data.tags
    n = sum(p.numel() for p in imported.model.parameters())
    text = card.text
    assert f"{n:,}" in text and f"`{ckpt}`" in text and blockformer.__version__ in text
    assert "family | gpt2" in text and "AutoModelForCausalLM.from_pretrained" in text
    config = json.loads(text.split("```json\n")[1].split("```")[0])
    assert config == imported.config.to_dict()


@pytest.mark.parametrize("arch, auto, pipeline", [
    ("BertForMaskedLM", "AutoModelForMaskedLM", "fill-mask"),
    ("MarianMTModel", "AutoModelForSeq2SeqLM", "translation"),
    ("BertForSequenceClassification", "AutoModelForSequenceClassification", "text-classification"),
    ("BertForTokenClassification", "AutoModelForTokenClassification", "token-classification"),
])
def test_the_card_loads_each_architecture_with_its_auto_class(arch, auto, pipeline):
    text = model_card({"architectures": [arch], "model_type": "bert"}, {"arch": "encoder"}, source="`ck`",
                      family="bert", n_params=1234, out="exported/x", tokenizer=False)
    card = huggingface_hub.ModelCard(text)
    assert card.data.pipeline_tag == pipeline and card.data.tags == ["blockformer", "bert"]
    assert f'model = {auto}.from_pretrained("exported/x")' in card.text and "AutoTokenizer" not in card.text
    assert "1,234 (1.23K)" in card.text
