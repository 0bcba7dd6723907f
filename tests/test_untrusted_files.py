"""Nothing a checkpoint or model directory brings is executed.

A payload (a pickle whose ``__reduce__`` would create a marker directory) is planted in
every file of every form a loader reads: a one-process checkpoint, a checkpoint with a
sharded ``dcp/`` (its ``.metadata``, a bytes item and a tensor item of its ``.distcp``),
and Hugging Face directories (``pytorch_model.bin``, sharded indexes, safetensors, JSON).
Each loading path (``load_checkpoint``, ``train --resume``, ``convert``, ``average``, the
DCP readers) must leave the marker absent and end in one clear line (exit 2 on the CLI).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from blockformer import TransformerConfig, build_model
from blockformer.cli import main
from blockformer.errors import UsageError
from blockformer.interop import from_hf, to_hf
from blockformer.parallel.checkpoint import DCP_DIR, consolidate, full_optimizer_state
from blockformer.run_config import load_run_config
from blockformer.train.checkpoint import load_checkpoint, load_trainer_state, read_config
from blockformer.train.finetune import lr_scale
from blockformer.train.loop import train
from blockformer.train.optim import build_optimizer

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(60))


class Payload:
    """Unpickled, it creates ``marker``: the proof that a file's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "payload-ran"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A one-process checkpoint after one step of a tiny language model."""
    tmp = tmp_path_factory.mktemp("trained")
    (tmp / "text.txt").write_text(TEXT, encoding="utf-8")
    cfg = load_run_config(overrides=[
        f"data.text={tmp / 'text.txt'}", f"data.cache_dir={tmp / 'cache'}", "data.seq_len=16",
        "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "model.norm=rms",
        "model.ffn=swiglu", "model.bias=false",  # exportable: a Llama-family model
        "train.batch_size=2", "train.steps=1", "train.warmup=1", "train.eval_every=0", "train.eval_batches=1",
        "train.progress=false", "train.precision=fp32", "train.compile=false", "train.samples=0",
    ])
    return train(cfg, tmp / "run", log=lambda *a: None).checkpoint


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_dcp(ckpt: Path) -> Path:
    """Turn a one-process checkpoint into one whose optimizer state lives only in ``dcp/``
    (as a parallel run writes it), in this one process."""
    loaded = load_checkpoint(ckpt)
    cfg, model = loaded.config, loaded.model.train()
    optimizer = build_optimizer(model, cfg.train, lr_scale(model, cfg))
    state = load_trainer_state(ckpt)
    optimizer.load_state_dict(state.pop("optimizer"))
    _dcp_save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
              ckpt / DCP_DIR)
    torch.save(state, ckpt / "trainer_state.pt")
    return ckpt


def _dcp_save(state: dict, directory: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def _assert_one_line(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], lines[0]


def _resume(ckpt: Path, capsys) -> tuple[int, str]:
    return _run(["train", "--resume", str(ckpt), "--set", "train.steps=2"], capsys)


# ---------------------------------------------------------------------- one-process checkpoints
def test_a_checkpoint_with_its_optimizer_state_in_dcp_resumes(trained, tmp_path, capsys):
    """The safe readers still read what DCP writes: tensors, and the bytes items (lr, betas)."""
    ckpt = _with_dcp(_copy(trained, tmp_path / "run" / trained.name))
    cfg = read_config(ckpt)
    model = load_checkpoint(ckpt).model
    full = full_optimizer_state(model, cfg, ckpt, load_trainer_state(ckpt))
    saved = torch.load(trained / "trainer_state.pt", weights_only=True)["optimizer"]
    assert full["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]
    assert full["param_groups"][0]["betas"] == tuple(saved["param_groups"][0]["betas"])
    name = next(iter(full["state"]))
    assert full["state"][name]["exp_avg"].abs().sum() > 0  # read, not the zeros it was read into
    weights = consolidate(ckpt / DCP_DIR, cfg, tp=1).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k
    code, err = _resume(ckpt, capsys)
    assert code == 0, err


ONE_PROCESS_FILES = ["config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"]


@pytest.mark.parametrize("name", ONE_PROCESS_FILES)
def test_a_payload_in_any_file_of_a_checkpoint_never_runs(trained, tmp_path, marker, capsys, name):
    ckpt = _copy(trained, tmp_path / "run" / trained.name)
    if name.endswith(".pt"):
        torch.save(Payload(marker), ckpt / name)
    else:
        (ckpt / name).write_bytes(pickle.dumps(Payload(marker)))
    if name != "trainer_state.pt":  # the only file inference does not read
        with pytest.raises(UsageError, match=name):
            load_checkpoint(ckpt)
    _assert_one_line(*_resume(ckpt, capsys), name)
    convert = _run(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")], capsys)
    if name == "trainer_state.pt":  # export does not read the trainer state
        assert convert[0] == 0, convert[1]
    else:
        _assert_one_line(*convert, name)
    if name != "trainer_state.pt":  # averaging does not read it either
        _assert_one_line(*_run(["average", "--checkpoints", str(ckpt), "--output", str(tmp_path / "avg")], capsys),
                         name)
    assert not marker.exists()


# ---------------------------------------------------------------------- dcp/
def _metadata(ckpt: Path):
    with open(ckpt / DCP_DIR / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file, trusted here


def _write_metadata(ckpt: Path, metadata) -> None:
    with open(ckpt / DCP_DIR / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _plant_tensor(ckpt: Path, prefix: str, blob: bytes) -> None:
    """Point the first tensor item whose name starts with ``prefix`` at ``blob``, appended
    to its ``.distcp`` file."""
    metadata = _metadata(ckpt)
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if i.fqn.startswith(prefix) and i.offset is not None)
    file = ckpt / DCP_DIR / info.relative_path
    info.offset, info.length = file.stat().st_size, len(blob)
    with open(file, "ab") as f:
        f.write(blob)
    _write_metadata(ckpt, metadata)


def _payload_bytes(marker: Path) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return buf.getvalue()


def _plant(kind: str, ckpt: Path, marker: Path) -> str:
    """Plant a payload of ``kind`` in ``ckpt``'s ``dcp/``; returns a word the error must name."""
    meta_file = ckpt / DCP_DIR / ".metadata"
    if kind == "metadata":
        meta_file.write_bytes(pickle.dumps(Payload(marker)))
        return ".metadata"
    if kind == "metadata-inside":  # a genuine Metadata carrying the payload in a field
        metadata = _metadata(ckpt)
        metadata.planner_data = {"x": Payload(marker)}
        _write_metadata(ckpt, metadata)
        return ".metadata"
    if kind == "rank-metadata":  # the per-rank file DCP falls back to
        os.replace(meta_file, ckpt / DCP_DIR / "__0.metadata")
        (ckpt / DCP_DIR / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        return ".metadata"
    if kind == "bytes-item":  # an lr that is a pickle of its own
        model = load_checkpoint(ckpt).model.train()
        cfg = read_config(ckpt)
        optimizer = build_optimizer(model, cfg.train, lr_scale(model, cfg))
        osd = get_optimizer_state_dict(model, optimizer)
        osd["param_groups"][0]["lr"] = Payload(marker)
        shutil.rmtree(ckpt / DCP_DIR)
        _dcp_save({"model": get_model_state_dict(model), "optim": osd}, ckpt / DCP_DIR)
        return "lr"
    if kind in ("optim-tensor", "model-tensor"):
        _plant_tensor(ckpt, kind.split("-")[0] + ".", _payload_bytes(marker))
        return DCP_DIR
    if kind == "path-out":  # a shard named outside dcp/ (a copy that would read fine)
        metadata = _metadata(ckpt)
        info = next(iter(metadata.storage_data.values()))
        outside = ckpt.parent.parent / "outside.distcp"
        shutil.copy(ckpt / DCP_DIR / info.relative_path, outside)
        for s in metadata.storage_data.values():
            s.relative_path = "../../../outside.distcp"
        _write_metadata(ckpt, metadata)
        return "outside.distcp"
    raise AssertionError(kind)


DCP_KINDS = ["metadata", "metadata-inside", "rank-metadata", "bytes-item", "optim-tensor", "model-tensor", "path-out"]


@pytest.mark.parametrize("kind", DCP_KINDS)
def test_a_payload_in_dcp_never_runs(trained, tmp_path, marker, capsys, kind):
    ckpt = _with_dcp(_copy(trained, tmp_path / "run" / trained.name))
    word = _plant(kind, ckpt, marker)
    cfg, state = read_config(ckpt), load_trainer_state(ckpt)
    if kind != "model-tensor":  # resuming reads the optimizer part only
        with pytest.raises(UsageError, match=word):
            full_optimizer_state(load_checkpoint(ckpt).model, cfg, ckpt, state)
        _assert_one_line(*_resume(ckpt, capsys), word)
    if kind not in ("bytes-item", "optim-tensor"):  # consolidating reads the model part only
        with pytest.raises(UsageError, match=word):
            consolidate(ckpt / DCP_DIR, cfg, tp=1)
    assert not marker.exists()


# ---------------------------------------------------------------------- Hugging Face directories
def _hf_dir(directory: Path) -> Path:
    """A tiny Llama-family directory written by ``to_hf``, with a ``tokenizer.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = TransformerConfig(arch="decoder", vocab_size=24, d_model=16, n_layers=1, n_heads=2, max_seq_len=16,
                            norm="rms", ffn="swiglu", position="rope", bias=False, scale_embeddings=False)
    to_hf(build_model(cfg, seed=0), directory)
    vocab = {f"w{i}": i for i in range(24)} | {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab = {k: v for k, v in vocab.items() if not (k.startswith("w") and int(k[1:]) < 4)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _to_bin(directory: Path) -> None:
    import safetensors.torch

    state = safetensors.torch.load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")


def _shard(directory: Path, ext: str) -> list[str]:
    """Split the weights into two shards with an index; returns the shard names."""
    import safetensors.torch

    state = safetensors.torch.load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(state)
    halves = {f"model-0000{k + 1}-of-00002.{ext}": names[k::2] for k in range(2)}
    for shard, keys in halves.items():
        part = {n: state[n].contiguous() for n in keys}
        if ext == "bin":
            torch.save(part, directory / shard)
        else:
            safetensors.torch.save_file(part, str(directory / shard))
    index = "model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json"
    weight_map = {n: shard for shard, keys in halves.items() for n in keys}
    (directory / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}), encoding="utf-8")
    return list(halves)


HF_CASES = ["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin", "bin-shard",
            "safetensors-shard", "pytorch_model.bin.index.json", "model.safetensors.index.json"]


@pytest.mark.parametrize("case", HF_CASES)
def test_a_payload_in_a_hugging_face_directory_never_runs(tmp_path, marker, capsys, case):
    d = _hf_dir(tmp_path / "hf")
    from_hf(d)  # the untouched directory imports
    blob = pickle.dumps(Payload(marker))
    if case == "pytorch_model.bin":
        _to_bin(d)
        torch.save(Payload(marker), d / case)
    elif case.endswith("-shard"):
        shard = _shard(d, case.split("-")[0])[0]
        if shard.endswith(".bin"):
            torch.save(Payload(marker), d / shard)
        else:
            (d / shard).write_bytes(blob)
        case = shard
    elif case.endswith(".index.json"):
        _shard(d, "bin" if case.startswith("pytorch") else "safetensors")
        (d / case).write_bytes(blob)
    else:
        (d / case).write_bytes(blob)
    with pytest.raises(UsageError, match=case):
        from_hf(d)
    _assert_one_line(*_run(["convert", "--from-hf", str(d), "--out", str(tmp_path / "out")], capsys), case)
    assert not marker.exists()


def test_a_legacy_pickle_bin_is_refused_too(tmp_path, marker, capsys):
    """``torch.save``'s old non-zip format, and a bare pickle, under the name of the weights."""
    d = _hf_dir(tmp_path / "hf")
    _to_bin(d)
    torch.save({"x": Payload(marker)}, d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    _assert_one_line(*_run(["convert", "--from-hf", str(d), "--out", str(tmp_path / "out")], capsys),
                     "pytorch_model.bin")
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(marker)))
    _assert_one_line(*_run(["convert", "--from-hf", str(d), "--out", str(tmp_path / "out")], capsys),
                     "pytorch_model.bin")
    assert not marker.exists()
