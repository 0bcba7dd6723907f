"""A whole training run: model+data+train+head+lora+parallel, TOML + --set; model: config; plumbing: schema.

What to train (``model``, the ``config.TransformerConfig`` of the architecture), on what
(``data``) and how (``train``, ``head``, ``lora``, ``parallel``); ``schema`` holds the
dataclass <-> dict/TOML machinery that this module and ``config`` share.

One typed dataclass per section, read from TOML, overridden on the command line with
``--set section.key=value`` and saved in every checkpoint's ``config.json``, so a run is
described by one file. Layers, later wins: defaults, a preset, a TOML file, ``--set``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .config import TransformerConfig
from .schema import check_types, describe, dumps_toml, is_union, suggest
from .errors import UsageError
from .nn.lora import LORA_TARGETS, LoraConfig  # noqa: F401 - the [lora] section; nn.lora owns it
from .textformats import loads_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

Schedule = Literal["noam", "cosine", "constant"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
Device = Literal["auto", "cpu", "cuda"]
NonFinite = Literal["stop", "skip"]
Resume = Literal["none", "auto"]
Objective = Literal["auto", "lm", "mlm"]
Compile = Literal["auto"]
BatchThreads = Literal["auto"]
Freeze = Literal["none", "embeddings", "body"]
HeadTask = Literal["none", "classify", "multilabel", "tokens", "regress"]
Pooling = Literal["auto", "cls", "mean", "last", "pooler"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
GradSync = Literal["last", "every"]
Checkpointing = Literal["none", "full", "selective"]
ReportTo = Literal["jsonl", "tensorboard"]  # train.report_to's entries (train/tracking.py)
REPORT_TO: tuple[str, ...] = get_args(ReportTo)


@dataclass
class DataConfig:
    """Where the tokens come from. Exactly one kind of source is used, chosen in this order:
    a synthetic ``task``; an aligned pair ``src``/``tgt`` (sequence-to-sequence); ``text``
    for language modelling (files, directories, globs, comma-separated, or ``stdlib``)."""

    text: str = "stdlib"
    src: str = ""  # aligned source/target files, one sentence per line (.gz read directly)
    tgt: str = ""
    val_src: str = ""  # optional held-out pair; by default val_fraction of src/tgt is held out
    val_tgt: str = ""
    task: str = ""  # copy | reverse | sort | add: generated on the fly
    task_min_len: int = 3  # copy/reverse/sort: source lengths (over the letters a-j)
    task_max_len: int = 12
    task_digits: int = 3  # add: digits per operand, at most
    heldout: int = 500  # synthetic examples held out for evaluation
    tokenizer: str = "byte"  # char | byte | bpe, or a path to a tokenizer.json / checkpoint
    vocab_size: int = 8000  # bpe only
    max_bytes: int | None = None  # cap on the text read (the stdlib corpus is ~30 MB)
    seq_len: int = 128  # language modelling window
    val_fraction: float = 0.1
    cache_dir: str = ""  # token-file cache; "" = ~/.cache/blockformer
    # --- labelled data for a task head (see [head])
    labels: str = ""  # text<TAB>label lines, or JSONL with "text" and "label"
    val_labels: str = ""  # its held-out file; by default val_fraction of `labels` is held out
    text_pair: str = ""  # text pairs: the JSONL key of each example's second text; TSV: text<TAB>pair<TAB>label
    # --- arrays for other inputs (model.input patches/frames): data sets a Python package ships
    dataset: str = ""  # digits | digit-strings (scikit-learn) | japanese-vowels (sktime); see data/arrays.py
    shift: int = 0  # images: training images moved by up to this many pixels each way
    max_digits: int = 4  # digit-strings: 1..max_digits digits side by side per image
    rotate: float = 0.0  # images: training images rotated by up to this many degrees each way
    zoom: float = 0.0  # images: training images scaled by a factor in [1 - zoom, 1 + zoom]

    def __post_init__(self) -> None:
        check_types(self, SECTION_OF[type(self).__name__])
        if self.shift < 0:
            raise UsageError(f"data.shift={self.shift!r}: expected an integer >= 0 (0 = no shifts)")
        if not 0.0 <= self.rotate <= 45.0:
            raise UsageError(f"data.rotate={self.rotate!r}: expected degrees in [0, 45] (0 = no rotation)")
        if not 0.0 <= self.zoom < 1.0:
            raise UsageError(f"data.zoom={self.zoom!r}: expected a float in [0, 1) (0 = no scaling)")
        if not self.dataset and self.augmentation:
            raise UsageError(f"{self.augmentation}: augments the images of a data.dataset; expected 0 without one")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise UsageError(f"data.max_bytes={self.max_bytes!r}: expected an integer >= 1 (unset: no cap)")
        _positive(self, "max_digits")
        _positive(self, "task_min_len", "task_max_len", "task_digits", "heldout", "vocab_size", "seq_len")
        if not 0.0 <= self.val_fraction < 1.0:
            raise UsageError(f"data.val_fraction={self.val_fraction!r}: expected a float in [0, 1)")
        if self.task_min_len > self.task_max_len:
            raise UsageError("data.task_min_len: expected <= data.task_max_len")
        if bool(self.src) != bool(self.tgt):
            raise UsageError("data.src/data.tgt: expected both files of the aligned pair, or neither")
        if self.text_pair and (self.text_pair.strip() != self.text_pair or self.text_pair in ("text", "label")):
            raise UsageError(f"data.text_pair={self.text_pair!r}: the JSONL key of each example's second text; "
                             f"expected a key other than 'text' and 'label', without spaces around it "
                             f"(e.g. 'text_pair')")
        if self.text_pair and not self.labels:
            raise UsageError(f"data.text_pair={self.text_pair!r}: a second text per labelled example; expected "
                             f"data.labels (a labelled file of text pairs)")

    @property
    def augmentation(self) -> str:
        """The first image augmentation asked for, as ``data.NAME=VALUE``; "" if none."""
        asked = [f"data.{name}={getattr(self, name)!r}" for name in ("shift", "rotate", "zoom") if getattr(self, name)]
        return asked[0] if asked else ""

    @property
    def kind(self) -> Literal["dataset", "task", "pairs", "labelled", "text"]:
        """Which objective the data asks for: a shipped data set of images or signals,
        synthetic task, aligned pairs, labelled examples (a task head) or plain text."""
        if self.dataset:
            return "dataset"
        if self.task:
            return "task"
        if self.src:
            return "pairs"
        return "labelled" if self.labels else "text"


@dataclass
class TrainConfig:
    """How to train. ``lr`` is the peak learning rate; under ``noam`` it is the factor
    multiplying the paper's ``d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)``."""

    name: str = "run"  # output goes to runs/<name> unless --out is given
    steps: int = 1000  # optimizer steps
    max_minutes: float = 0.0  # stop (saving a checkpoint) after this much training time; 0 = off
    batch_size: int = 32  # sequences per micro-batch (language modelling, synthetic tasks)
    max_tokens: int = 2048  # aligned pairs: padded tokens per micro-batch (length-bucketed)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-4
    schedule: Schedule = "cosine"
    warmup: int = 100  # steps of linear warmup (noam: the paper's warmup_steps)
    min_lr: float = 0.0  # cosine floor
    weight_decay: float = 0.1  # decoupled (AdamW); never on norms, biases, embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    label_smoothing: float = 0.0
    precision: Precision = "fp32"  # auto: bf16 where the device has bf16 units, else fp32
    device: Device = "auto"
    compile: bool | Compile = "auto"  # auto: on for models whose blocks hold >= 20M weights (train/compile.py)
    # CPU: each micro-batch's rows split over this many threads, side by side (parallel/threads.py);
    # auto: torch's thread count on a 2-thread CPU run with nothing in the way, else 1
    batch_threads: int | BatchThreads = "auto"
    seed: int = 0
    eval_every: int = 200  # also saves a checkpoint; 0 = only at the end
    eval_batches: int = 20
    eval_samples: int = 200  # synthetic tasks: held-out examples decoded for exact match
    log_every: int = 10
    keep_last: int = 2  # checkpoints kept besides the best
    # a parallel run's checkpoints also hold model.safetensors, streamed from their dcp/ by rank 0 a
    # tensor at a time; false: dcp/ only (`blockformer convert --consolidate` writes it later)
    consolidate: bool = True
    progress: bool = True
    samples: int = 3  # language modelling: texts sampled at the end of `blockformer train`
    sample_tokens: int = 200
    sample_prompts: list[str] = field(default_factory=lambda: [""])  # cycled over the samples
    # --- reliability (issue 9)
    nonfinite: NonFinite = "stop"  # a NaN/inf loss: "stop" the run (exit 3) or "skip" that step's update
    # auto: continue from the run directory's latest complete checkpoint if it has one, else start
    # fresh (what a torchrun --max-restarts restart needs; train/run_dir.py); none: --resume decides
    resume: Resume = "none"
    # --- objective, and fine-tuning from a checkpoint
    objective: Objective = "auto"  # auto: the data decides (text: lm, or mlm for an encoder)
    mask_rate: float = 0.15  # mlm: share of positions selected (Devlin et al. 2019)
    mask_token_rate: float = 0.8  # of the selected: replaced by the mask token
    random_token_rate: float = 0.1  # of the selected: replaced by a random token (the rest kept)
    init_from: str = ""  # a checkpoint whose body (and head, where it fits) starts this run
    freeze: Freeze = "none"  # embeddings | body (everything but the task head)
    layer_lr_decay: float = 1.0  # lr x decay^depth-from-the-top per block (Clark et al. 2020)
    head_lr: float = 0.0  # the task head's peak lr; 0 = train.lr
    # Memory: recompute activations in the backward pass (blockformer.parallel.activation).
    activation_checkpointing: Checkpointing = "none"  # full: every block; selective: all but matmuls
    # --- tracking (issue 24): metrics.jsonl is always written; "tensorboard" adds <run_dir>/tensorboard/
    report_to: list[str] = field(default_factory=lambda: ["jsonl"])

    def __post_init__(self) -> None:
        check_types(self, SECTION_OF[type(self).__name__])
        _check_report_to(self.report_to)
        for name in ("mask_rate", "mask_token_rate", "random_token_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UsageError(f"train.{name}={getattr(self, name)!r}: expected a float in [0, 1]")
        if self.mask_token_rate + self.random_token_rate > 1.0:
            raise UsageError("train.mask_token_rate + train.random_token_rate: expected a sum <= 1")
        if not 0.0 < self.layer_lr_decay <= 1.0:
            raise UsageError(f"train.layer_lr_decay={self.layer_lr_decay!r}: expected a float in (0, 1]")
        if self.head_lr < 0:
            raise UsageError(f"train.head_lr={self.head_lr!r}: expected a float >= 0 (0 = train.lr)")
        prompts = self.sample_prompts
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise UsageError(f"train.sample_prompts={self.sample_prompts!r}: expected a list of strings")
        _positive(self, "steps", "batch_size", "max_tokens", "grad_accum", "eval_batches", "log_every")
        _positive(self, "keep_last", "eval_samples")
        if self.batch_threads != "auto":
            _positive(self, "batch_threads")
        for name in ("lr", "eps"):
            if getattr(self, name) <= 0:
                raise UsageError(f"train.{name}={getattr(self, name)!r}: expected a float > 0")
        if self.max_minutes < 0:
            raise UsageError(f"train.max_minutes={self.max_minutes!r}: expected a float >= 0 (0 = no limit)")
        for name in ("warmup", "eval_every"):
            if getattr(self, name) < 0:
                raise UsageError(f"train.{name}={getattr(self, name)!r}: expected an integer >= 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UsageError(f"train.label_smoothing={self.label_smoothing!r}: expected a float in [0, 1)")
        for name in ("beta1", "beta2"):  # torch would say only "Invalid beta parameter at index 0"
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"train.{name}={getattr(self, name)!r}: expected a float in [0, 1)")
        for name in ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise UsageError(f"train.{name}={getattr(self, name)!r}: expected a float >= 0 (0 = off)")
        for name in ("seed", "samples", "sample_tokens"):
            if getattr(self, name) < 0:
                raise UsageError(f"train.{name}={getattr(self, name)!r}: expected an integer >= 0")
        if self.min_lr < 0 or (self.schedule == "cosine" and self.min_lr > self.lr):
            raise UsageError(f"train.min_lr={self.min_lr!r}: expected a float in [0, train.lr={self.lr!r}] "
                             f"(the cosine schedule's floor)")
        name = self.name
        if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
            raise UsageError(f"train.name={name!r}: expected a plain directory name (runs/<train.name>): "
                             f"not empty, no / or \\, not . or ..; use --out DIR for another place")
        if self.schedule == "noam" and self.warmup == 0:
            raise UsageError("train.warmup=0: expected an integer >= 1 with schedule='noam'")


def _check_report_to(value: Any) -> None:
    """A list of known reporters; a typo names the closest one, so a run is not trained unlogged."""
    expected = "a list of " + ", ".join(map(repr, REPORT_TO)) + " (jsonl is always written)"
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"train.report_to={value!r}: expected {expected}")
    for entry in value:
        if entry not in REPORT_TO:
            raise UsageError(f"train.report_to={value!r}: unknown entry {entry!r}{suggest(entry, list(REPORT_TO))}; "
                             f"expected {expected}")


def _positive(obj: Any, *names: str) -> None:
    section = SECTION_OF[type(obj).__name__]
    for name in names:
        if getattr(obj, name) < 1:
            raise UsageError(f"{section}.{name}={getattr(obj, name)!r}: expected an integer >= 1")


@dataclass
class HeadConfig:
    """A task head on the model's last hidden states (none: the model's own LM/MLM head).

    ``classify``: one label per text (cross-entropy); ``multilabel``: any subset of the
    labels (sigmoid + binary cross-entropy); ``tokens``: one label per word; ``regress``: one
    number per text (mean squared error). ``labels`` is filled in from the training data."""

    task: HeadTask = "none"
    pooling: Pooling = "auto"  # auto: cls for encoders, last for decoders; pooler: the body's (BERT's)
    bias: bool = True  # a sequence head's bias (Hugging Face decoders' score layers have none)
    dropout: float = 0.1
    class_weights: str = ""  # "balanced" (inverse frequency) or "label=weight,label=weight"
    labels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_types(self, SECTION_OF[type(self).__name__])
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"head.dropout={self.dropout!r}: expected a float in [0, 1)")
        if not isinstance(self.labels, list) or not all(isinstance(x, str) for x in self.labels):
            raise UsageError(f"head.labels={self.labels!r}: expected a list of strings")


@dataclass
class ParallelConfig:
    """How a run launched with ``torchrun`` spreads over its processes (blockformer.parallel).

    The degrees multiply to the world size; ``dp_shard = -1`` takes what the others leave.
    One process with the defaults is the plain single-device run.
    """

    dp_shard: int = -1  # FSDP2 (fully_shard) degree; -1 = world size / (dp_replicate * tp * pp)
    dp_replicate: int = 1  # DDP replicas (HSDP when dp_shard > 1 too)
    tp: int = 1  # tensor parallel degree (Megatron-style column/row split of each matmul;
    # with it, norms on sequence shards and the training loss on vocabulary shards)
    pp: int = 1  # pipeline stages (decoder only)
    pp_schedule: PipelineSchedule = "1f1b"
    pp_microbatches: int = 0  # micro-batches per step in the pipeline; 0 = 2 * pp
    timeout: float = 300.0  # seconds a collective waits for a rank before the job ends (torch: 1800)
    # under train.grad_accum: gradients cross ranks in the "last" micro-batch's backward only
    # (FSDP holds them unsharded until then), or in "every" one's (sharded all along)
    grad_sync: GradSync = "last"

    def __post_init__(self) -> None:
        check_types(self, SECTION_OF[type(self).__name__])
        _positive(self, "dp_replicate", "tp", "pp")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise UsageError(f"parallel.dp_shard={self.dp_shard!r}: expected an integer >= 1, or -1 (the rest)")
        if self.pp_microbatches < 0:
            raise UsageError(f"parallel.pp_microbatches={self.pp_microbatches!r}: expected an integer >= 0")
        if self.timeout <= 0:
            raise UsageError(f"parallel.timeout={self.timeout!r}: expected seconds > 0 (how long a collective "
                             f"waits for a rank that stopped answering)")


SECTION_OF = {"DataConfig": "data", "TrainConfig": "train", "TransformerConfig": "model",
              "HeadConfig": "head", "LoraConfig": "lora", "ParallelConfig": "parallel"}


@dataclass
class RunConfig:
    model: TransformerConfig = field(default_factory=TransformerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        check_keys(data)
        return cls(
            model=TransformerConfig(**data.get("model", {})),
            data=DataConfig(**data.get("data", {})),
            train=TrainConfig(**data.get("train", {})),
            head=HeadConfig(**data.get("head", {})),
            lora=LoraConfig(**data.get("lora", {})),
            parallel=ParallelConfig(**data.get("parallel", {})),
        )

    def to_toml(self, path: str | Path | None = None) -> str:
        text = dumps_toml(self.to_dict())
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


SECTIONS: dict[str, type] = {"model": TransformerConfig, "data": DataConfig, "train": TrainConfig,
                             "head": HeadConfig, "lora": LoraConfig, "parallel": ParallelConfig}


def check_keys(data: dict[str, Any]) -> None:
    """Unknown sections or keys raise UsageError naming them and the closest valid name."""
    for section, values in data.items():
        if section not in SECTIONS:
            hint = suggest(section, list(SECTIONS))
            raise UsageError(f"[{section}]: unknown section{hint}; expected one of " + ", ".join(SECTIONS))
        if not isinstance(values, dict):
            raise UsageError(f"{section}: expected a table of key = value")
        names = [f.name for f in fields(SECTIONS[section])]
        for key in values:
            if key not in names:
                raise UsageError(f"{section}.{key}: unknown key{suggest(key, names)}")


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; missing, empty or malformed files raise UsageError."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: config file not found")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is skipped
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start}); expected a TOML file saved as UTF-8") from None
    if not text.strip():
        raise UsageError(f"{path}: config file is empty; expected [model], [data] and [train] tables")
    try:
        data = loads_toml(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: not valid TOML ({e})") from None
    check_keys(data)
    return data


# ---------------------------------------------------------------------- presets
def preset_names() -> list[str]:
    files = resources.files("blockformer.presets").iterdir()
    return sorted(f.name[: -len(".toml")] for f in files if f.name.endswith(".toml"))


def read_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        hint = suggest(name, names)
        raise UsageError(f"--preset {name}: unknown preset{hint}; available: " + ", ".join(names))
    text = resources.files("blockformer.presets").joinpath(f"{name}.toml").read_text(encoding="utf-8")
    data = loads_toml(text)
    check_keys(data)
    return data


# ---------------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[str, str, Any]:
    """``"train.lr=1e-3"`` -> ``("train", "lr", 0.001)``, typed by the field's annotation."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise UsageError(f"--set {item}: expected section.key=value, e.g. train.lr=1e-3")
    dotted, raw = item.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    check_keys({section: {key: None}})
    hint = get_type_hints(SECTIONS[section])[key]
    return section, key, _parse_value(f"{section}.{key}", raw.strip(), hint)


def _parse_value(name: str, raw: str, hint: Any) -> Any:
    options = get_args(hint) if is_union(hint) else (hint,)
    if type(None) in options and raw.lower() in ("none", "null"):
        return None
    for option in options:
        try:
            return _convert(raw, option)
        except ValueError:
            continue
    raise UsageError(f"--set {name}={raw}: expected {describe(hint)}")


def _convert(raw: str, hint: Any) -> Any:
    if get_origin(hint) is Literal:
        if raw in get_args(hint):
            return raw
        raise ValueError(raw)
    if hint is bool:
        table = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if raw.lower() in table:
            return table[raw.lower()]
        raise ValueError(raw)
    if hint is int:
        return int(raw)
    if hint is float:
        return float(raw)
    if hint is str:
        return raw
    if get_origin(hint) is list:  # --set train.sample_prompts="def ,class ", or a TOML array
        return [_convert(part, get_args(hint)[0]) for part in _list_parts(raw)]
    raise ValueError(raw)


def _list_parts(raw: str) -> list[str]:
    """A TOML array of strings (``["jsonl","tensorboard"]``, as a TOML file spells the list)
    as its entries; anything else (a prompt such as ``[INST]``) split at its commas."""
    if raw.startswith("[") and raw.endswith("]"):
        try:
            value = loads_toml(f"v = {raw}").get("v")
        except tomllib.TOMLDecodeError:
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return raw.split(",")


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` laid over ``base``, section by section."""
    out = {section: dict(values) for section, values in base.items()}
    for section, values in update.items():
        out.setdefault(section, {}).update(values)
    return out


def load_run_config(
    config: str | Path | None = None, preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Defaults, then ``preset``, then the TOML file ``config``, then ``--set`` overrides."""
    data: dict[str, Any] = {}
    if preset:
        data = merge(data, read_preset(preset))
    if config:
        data = merge(data, read_toml(config))
    for item in overrides:
        section, key, value = parse_override(item)
        data = merge(data, {section: {key: value}})
    return RunConfig.from_dict(data)
