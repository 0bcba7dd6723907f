"""Names people type, and the card an export carries.

``resolve_source("gpt2")`` (or ``"org/name"``, ``"org/name@revision"``, ``"org/name@<commit>"``)
is the model's snapshot in the local Hugging Face cache, found the way transformers finds it
offline: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, then
``models--org--name/refs/<revision>`` -> ``snapshots/<commit>/``. The lookup is
huggingface_hub's own (``snapshot_download(..., local_files_only=True)``), which reads only
the disk: nothing is ever downloaded. An existing local directory always wins over a name.

``model_card(...)`` is the ``README.md`` of an export: what it was made from, and how to load it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import UsageError

# A Hub repo id, optionally @revision: "gpt2", "org/name", "org/name@v1.0", "org/name@<40 hex>".
# Anything else ("./x", "a/b/c", "~/m", "C:\\m") is a path, and read_hf_config says what is wrong with it.
_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<revision>[\w.][\w./-]*))?")


def hub_cache() -> Path:
    """The Hugging Face cache directory, as huggingface_hub and transformers choose it. Read
    from the environment at each call: huggingface_hub reads it once, when it is imported."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second: huggingface_hub's older name
        if env.get(var):
            return Path(os.path.expandvars(env[var])).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def resolve_source(source: str | Path) -> Path:
    """A Hugging Face model directory: ``source`` itself when it exists (or is a ``Path``, or
    does not look like a repo id), else the cached snapshot of the model it names. A name
    that is not cached is a one-line error naming the cache directory."""
    path = Path(source)
    if isinstance(source, Path) or path.exists():
        return path
    match = _NAME.fullmatch(source)
    if match is None:
        return path
    repo, revision = match["repo"], match["revision"] or "main"
    cache = hub_cache()
    looked = cache / f"models--{repo.replace('/', '--')}"
    expected = (f"expected a local Hugging Face model directory, or a model in that cache (download it first, "
                f"e.g. `hf download {repo}`, or set HF_HUB_CACHE or HF_HOME to the cache that holds it)")
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415
        from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415
    except ImportError:
        raise UsageError(f"{source}: not a local directory; finding it in the Hugging Face cache needs "
                         f"huggingface_hub (pip install 'blockformer[hf]'); expected a local model directory") from None
    try:
        # local_files_only: huggingface_hub reads refs/ and snapshots/ and makes no request at all.
        found = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError as e:  # not cached, or (IncompleteSnapshotError) only partly
        what = "only partly" if "incomplete" in str(e).lower() else "not"
        at = f" at revision {revision!r}" if match["revision"] else ""
        raise UsageError(f"{source}: not a local directory, and {what} in the Hugging Face cache {cache}{at} "
                         f"(looked for {looked.name}/refs/{revision} -> snapshots/); {expected}") from None
    except ValueError as e:  # huggingface_hub's HFValidationError: not a valid repo id after all
        raise UsageError(f"{source}: not a local directory, nor a valid Hub model name ({e}); "
                         f"expected a local Hugging Face model directory or org/name") from None
    return Path(found)


# ---------------------------------------------------------------------- model card
# architecture -> (the transformers Auto class that loads it, the Hub's pipeline tag)
_AUTO = {
    "GPT2LMHeadModel": ("AutoModelForCausalLM", "text-generation"),
    "LlamaForCausalLM": ("AutoModelForCausalLM", "text-generation"),
    "BertForMaskedLM": ("AutoModelForMaskedLM", "fill-mask"),
    "BertModel": ("AutoModel", "feature-extraction"),
    "T5ForConditionalGeneration": ("AutoModelForSeq2SeqLM", "text2text-generation"),
    "BartForConditionalGeneration": ("AutoModelForSeq2SeqLM", "text2text-generation"),
    "MarianMTModel": ("AutoModelForSeq2SeqLM", "translation"),
}
# A task head's class, <Family>For<Task> (interop/heads.py): the Auto class of the same task.
_AUTO_TASKS = {
    "ForSequenceClassification": ("AutoModelForSequenceClassification", "text-classification"),
    "ForTokenClassification": ("AutoModelForTokenClassification", "token-classification"),
}


def _version() -> str:
    """The installed blockformer's version (the package's metadata, as pip wrote it)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("blockformer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def model_card(hf_config: dict[str, Any], blockformer_config: dict[str, Any], *, source: str, family: str,
               n_params: int, out: str, tokenizer: bool) -> str:
    """The ``README.md`` of an exported directory: YAML front matter the Hub reads
    (``library_name``, ``tags``, ``pipeline_tag``), then what was exported from what and how
    to load it. ``source``: Markdown, e.g. a checkpoint path in backticks."""
    __version__ = _version()

    arch = (hf_config.get("architectures") or ["AutoModel"])[0]
    model_type = hf_config.get("model_type", family)
    task = next((v for k, v in _AUTO_TASKS.items() if arch.endswith(k)), (arch, None))
    auto, pipeline = _AUTO.get(arch, task)
    tags = ["blockformer", *dict.fromkeys([family, model_type])]
    front = ["---", "library_name: transformers", "tags:", *(f"- {t}" for t in tags)]
    front += [f"pipeline_tag: {pipeline}"] if pipeline else []
    front += ["---"]
    imports = f"{auto}, AutoTokenizer" if tokenizer else auto
    where = json.dumps(out)  # a Python string literal, in double quotes
    load = [f"from transformers import {imports}", "", f"model = {auto}.from_pretrained({where})"]
    load += [f"tokenizer = AutoTokenizer.from_pretrained({where})"] if tokenizer else []
    return "\n".join([
        *front, "",
        f"# {Path(out).name or out}",
        "",
        f"A blockformer {blockformer_config.get('arch', 'model')} exported as a Hugging Face `{model_type}` "
        f"(`{arch}`) by blockformer {__version__}.",
        "",
        "| | |", "| --- | --- |",
        f"| source | {source} |",
        f"| family | {family} (`model_type: {model_type}`) |",
        f"| architecture | `{arch}` (blockformer `arch = \"{blockformer_config.get('arch')}\"`) |",
        f"| parameters | {n_params:,} ({_short(n_params)}) |",
        f"| tokenizer | {'tokenizer.json (Hugging Face ids)' if tokenizer else 'none (the checkpoint had no tokenizers tokenizer)'} |",
        f"| blockformer | {__version__} |",
        "",
        "## Load it with transformers", "",
        "```python", *load, "```", "",
        f"Back into blockformer: `blockformer convert --from-hf {out} --out runs/imported`.", "",
        "## The blockformer config", "",
        "```json", json.dumps(blockformer_config, indent=2), "```", "",
    ])


def _short(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
