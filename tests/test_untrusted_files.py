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
from blockformer.parallel.checkpoint import DCP_DIR, dcp_weights, full_optimizer_state
from blockformer.run_config import load_run_config
from blockformer.train.finetune import lr_scale
from blockformer.train.load import load_checkpoint, load_trainer_state, read_config
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


def _scratch(model, cfg):
    """A fresh optimizer over ``model`` with the run's parameter groups, as the loop builds it."""
    return build_optimizer(model, cfg.train, lr_scale(model, cfg))


# ---------------------------------------------------------------------- one-process checkpoints
def test_a_checkpoint_with_its_optimizer_state_in_dcp_resumes(trained, tmp_path, capsys):
    """The safe readers still read what DCP writes: tensors, and the bytes items (lr, betas)."""
    ckpt = _with_dcp(_copy(trained, tmp_path / "run" / trained.name))
    cfg = read_config(ckpt)
    model = load_checkpoint(ckpt).model
    full = full_optimizer_state(model, _scratch(model, cfg), ckpt, load_trainer_state(ckpt))
    saved = torch.load(trained / "trainer_state.pt", weights_only=True)["optimizer"]
    assert full["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]
    assert full["param_groups"][0]["betas"] == tuple(saved["param_groups"][0]["betas"])
    name = next(iter(full["state"]))
    assert full["state"][name]["exp_avg"].abs().sum() > 0  # read, not the zeros it was read into
    weights, held = dcp_weights(ckpt, cfg), model.state_dict()
    assert weights.keys() <= held.keys() and len(weights) >= len(dict(model.named_parameters()))
    for k, v in weights.items():
        assert torch.equal(v, held[k]), k
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
            model = load_checkpoint(ckpt).model
            full_optimizer_state(model, _scratch(model, cfg), ckpt, state)
        _assert_one_line(*_resume(ckpt, capsys), word)
    if kind not in ("bytes-item", "optim-tensor"):  # consolidating reads the model part only
        with pytest.raises(UsageError, match=word):
            dcp_weights(ckpt, cfg)
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


# ---------------------------------------------------------------------- shard indexes and config.json
def _convert_refused(d: Path, tmp_path: Path, capsys, *names: str) -> None:
    with pytest.raises(UsageError):
        from_hf(d)
    _assert_one_line(*_run(["convert", "--from-hf", str(d), "--out", str(tmp_path / "out")], capsys), *names)


@pytest.mark.parametrize("ext", ["safetensors", "bin"])
@pytest.mark.parametrize("where", ["parent", "absolute", "nested-parent"])
def test_a_shard_index_naming_a_file_outside_the_directory_is_refused(tmp_path, capsys, ext, where):
    d = _hf_dir(tmp_path / "hf")
    shard = _shard(d, ext)[0]
    outside = tmp_path / f"outside.{ext}"
    shutil.copy(d / shard, outside)  # a readable file: only its place is wrong
    name = {"parent": f"../outside.{ext}", "absolute": str(outside), "nested-parent": f"sub/../../outside.{ext}"}[where]
    index = d / ("model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json")
    data = json.loads(index.read_text())
    entry = next(k for k, v in data["weight_map"].items() if v == shard)
    data["weight_map"][entry] = name
    index.write_text(json.dumps(data))
    _convert_refused(d, tmp_path, capsys, index.name, entry, "leaves the model directory")


INDEX_DAMAGE = {
    "not an object": lambda data: [1, 2],
    "no weight_map": lambda data: {"metadata": {}},
    "weight_map a list": lambda data: {"weight_map": list(data["weight_map"])},
    "a shard name not a string": lambda data: {"weight_map": {**data["weight_map"], "extra": 5}},
    "a tensor name not a string": lambda data: {"weight_map": {k: [v] for k, v in data["weight_map"].items()}},
    "missing shard": lambda data: {"weight_map": {**data["weight_map"], "extra": "model-00009-of-00009.safetensors"}},
}


@pytest.mark.parametrize("damage", list(INDEX_DAMAGE))
def test_a_malformed_shard_index_is_one_line(tmp_path, capsys, damage):
    d = _hf_dir(tmp_path / "hf")
    _shard(d, "safetensors")
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps(INDEX_DAMAGE[damage](json.loads(index.read_text()))))
    _convert_refused(d, tmp_path, capsys, index.name, *(["model-00009-of-00009"] if damage == "missing shard" else []))


# A valid config.json for each family (the fields it must have); every field it reads, given
# a list, an object or a string where it expects something else, is one line naming the field.
BASES = {
    "gpt2": {"vocab_size": 24, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 16},
    "llama": {"vocab_size": 24, "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
              "intermediate_size": 32, "max_position_embeddings": 16},
    "bert": {"vocab_size": 24, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 32, "max_position_embeddings": 16},
    "t5": {"vocab_size": 24, "d_model": 16, "num_heads": 2, "d_kv": 8, "num_layers": 1, "d_ff": 32},
    "bart": {"vocab_size": 24, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
             "encoder_attention_heads": 2, "encoder_ffn_dim": 32, "max_position_embeddings": 16},
}
BASES["marian"] = BASES["bart"]
OPTIONAL = {
    "gpt2": ["scale_attn_by_inverse_layer_idx", "add_cross_attention", "activation_function", "n_inner",
             "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights"],
    "llama": ["hidden_act", "attention_bias", "mlp_bias", "head_dim", "sliding_window", "num_key_value_heads",
              "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters"],
    "bert": ["position_embedding_type", "is_decoder", "hidden_act", "layer_norm_eps", "type_vocab_size"],
    "t5": ["feed_forward_proj", "tie_word_embeddings", "scale_decoder_outputs", "num_decoder_layers",
           "n_positions", "layer_norm_epsilon", "relative_attention_num_buckets", "relative_attention_max_distance"],
    "bart": ["decoder_attention_heads", "decoder_ffn_dim", "normalize_before", "add_final_layer_norm",
             "activation_function", "tie_word_embeddings", "scale_embedding"],
    "marian": ["normalize_embedding", "share_encoder_decoder_embeddings"],
}


@pytest.mark.parametrize("family", list(BASES))
def test_config_fields_of_the_wrong_json_type_are_named(family):
    from blockformer.interop.families import family_for_model_type

    fam = family_for_model_type(family, "config.json")
    fam.config_from_hf(BASES[family], lambda name: False, "config.json")  # the base is valid
    for key in [*BASES[family], *OPTIONAL[family]]:
        for bad in ([], {}, "x", [1]):
            if bad == {} and key.startswith("rope_"):  # an empty object: no scaling, the default theta
                continue
            hf = {**BASES[family], key: bad}
            with pytest.raises(UsageError, match=f"config.json: {key}=") as e:
                fam.config_from_hf(hf, lambda name: False, "config.json")
            assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("field, value", [("model_type", []), ("model_type", {}), ("hidden_size", "x"),
                                          ("vocab_size", {}), ("num_attention_heads", 2.5), ("rms_norm_eps", "1e-6"),
                                          ("tie_word_embeddings", "false"), ("rope_scaling", ["linear"])])
def test_convert_names_a_config_field_of_the_wrong_type(tmp_path, capsys, field, value):
    d = _hf_dir(tmp_path / "hf")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, field: value}))
    _convert_refused(d, tmp_path, capsys, "config.json", field)


def test_a_tokenizer_json_without_tokens_is_one_line(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    d = _hf_dir(tmp_path / "hf")
    Tokenizer(models.WordLevel({}, unk_token="<unk>")).save(str(d / "tokenizer.json"))
    _convert_refused(d, tmp_path, capsys, "tokenizer.json", "empty vocabulary")
