"""What the attention, next-token and playground pages ask of a checkpoint.

Everything goes through the public API: ``load_checkpoint`` for the model and tokenizer,
the attention probe's ``capture`` for each layer's and head's weights (it recomputes them
from the module's own projections and checks them against the module's output),
the model's forward for next-token probabilities, and ``generate`` for the playground.
Nothing here computes attention itself. A loaded checkpoint is kept (a few, least
recently used dropped first), so typing new text does not reload the weights.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..generate import generate
from ..probes.attention import capture
from ..tokenizers import BOS_ID, UNK_ID
from ..train.load import Checkpoint, load_checkpoint

MAX_TOKENS = 512  # the most tokens a page shows attention or next tokens for
MAX_CHARS = 20_000  # longer text is refused before it is tokenized
MAX_NEW_TOKENS = 1024  # the playground's longest continuation
KEEP = 3  # loaded checkpoints kept in memory


class Checkpoints:
    """Loaded checkpoints by path, the least recently used dropped past ``KEEP``."""

    def __init__(self) -> None:
        self._loaded: OrderedDict[Path, Checkpoint] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: Path) -> Checkpoint:
        with self._lock:
            if path in self._loaded:
                self._loaded.move_to_end(path)
                return self._loaded[path]
        ckpt = _load(path)
        with self._lock:
            self._loaded[path] = ckpt
            while len(self._loaded) > KEEP:
                self._loaded.popitem(last=False)
        return ckpt


def _load(path: Path) -> Checkpoint:
    """``load_checkpoint``, its errors as one-line UsageErrors (a damaged or foreign
    checkpoint may raise many kinds)."""
    try:
        return load_checkpoint(path)
    except UsageError:
        raise
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as e:
        text = " ".join(str(e).split()) or type(e).__name__
        raise UsageError(f"{path}: cannot be loaded ({text[:300]}); expected a checkpoint written by "
                         f"`blockformer train`") from None


def _check_text_model(ckpt: Checkpoint) -> None:
    cfg = ckpt.config.model
    if cfg.input != "tokens":
        raise UsageError(f"this checkpoint reads {cfg.input}, not text; see `blockformer probe attention "
                         f"--checkpoint {ckpt.path}` for what it attends to in an image")


def encode(ckpt: Checkpoint, text: str, name: str = "text", allow_empty: bool = False) -> list[int]:
    """Token ids of ``text``; characters the tokenizer cannot spell and over-long texts are
    refused with a message naming them."""
    if not isinstance(text, str):
        raise UsageError(f"{name}: expected a string")
    if len(text) > MAX_CHARS:
        raise UsageError(f"{name}: {len(text):,} characters; expected at most {MAX_CHARS:,} (shorten it)")
    ids = ckpt.tokenizer.encode(text)
    if not ids and not allow_empty:
        raise UsageError(f"{name}: encodes to no tokens; expected some text")
    if UNK_ID in ids:
        unknown = sorted({c for c in text if UNK_ID in ckpt.tokenizer.encode(c)})
        shown = ", ".join(repr(c) for c in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        raise UsageError(f"{name}: {len(unknown)} character(s) outside the tokenizer's vocabulary ({shown}); "
                         f"expected text made of the characters the model was trained on")
    limit = min(MAX_TOKENS, ckpt.config.model.max_seq_len)
    if len(ids) > limit:
        why = "the model's max_seq_len" if limit < MAX_TOKENS else "the page's limit"
        raise UsageError(f"{name}: {len(ids):,} tokens; expected at most {limit} ({why}); shorten it")
    return ids


def token_names(ckpt: Checkpoint, ids: list[int]) -> list[str]:
    """One label per id: its text, or the special's name."""
    return ["<s>" if i == BOS_ID else ckpt.tokenizer.decode([i]) or f"<{i}>" for i in ids]


def attention(ckpt: Checkpoint, text: str, target: str = "") -> dict[str, Any]:
    """Every attention module's weights (heads, queries, keys) for ``text`` (and, for an
    encoder-decoder, ``target`` after ``<s>``), with what each module is."""
    _check_text_model(ckpt)
    cfg, model = ckpt.config.model, ckpt.model
    ids = encode(ckpt, text)
    src = torch.tensor([ids])
    if cfg.arch == "encoder-decoder":
        tgt = [BOS_ID] + encode(ckpt, target, "target", allow_empty=True)[: cfg.max_seq_len - 1]
        records = capture(model, lambda: model(src, torch.tensor([tgt])))
    else:
        tgt = []
        records = capture(model, lambda: model(src))
    src_names, tgt_names = token_names(ckpt, ids), token_names(ckpt, tgt)
    layers = []
    for r in records:
        decoder_side = cfg.arch == "encoder-decoder" and r["module"].startswith("decoder")
        causal = (cfg.arch == "decoder" or decoder_side) and not r["cross"]
        kind = "cross" if r["cross"] else "causal" if causal else "bidirectional"
        layers.append({"module": r["module"], "kind": kind, "queries": tgt_names if decoder_side else src_names,
                       "keys": src_names if r["cross"] or not decoder_side else tgt_names,
                       "weights": _rounded(r["weights"]), "reproduction_error": r["error"]})
    return {"checkpoint": str(ckpt.path), "arch": cfg.arch, "tokens": src_names, "target_tokens": tgt_names,
            "n_heads": cfg.n_heads, "layers": layers}


def _rounded(weights: torch.Tensor) -> list:
    """The weights as lists, to 7 decimals (off by at most 5e-8; a float32's noise digits would
    double the page's size)."""
    return (weights.double() * 1e7).round().div(1e7).tolist()


def next_tokens(ckpt: Checkpoint, text: str, k: int = 5) -> dict[str, Any]:
    """Per position of ``text``, the model's ``k`` likeliest next tokens and their probabilities."""
    _check_text_model(ckpt)
    if ckpt.config.model.arch != "decoder" or ckpt.config.head.task != "none":
        raise UsageError(f"next tokens: this checkpoint is {_what(ckpt)}; expected a decoder language model")
    if not isinstance(k, int) or not 1 <= k <= 50:
        raise UsageError(f"k: {k!r}; expected a whole number from 1 to 50")
    ids = encode(ckpt, text)
    with torch.no_grad():
        probs = ckpt.model(torch.tensor([ids]))[0].float().softmax(-1)  # (T, V)
    top = probs.topk(min(k, probs.shape[-1]), dim=-1)
    names = token_names(ckpt, ids)
    positions = []
    for t in range(len(ids)):
        choices = [{"token": token_names(ckpt, [i])[0], "id": i, "prob": p}
                   for i, p in zip(top.indices[t].tolist(), top.values[t].tolist())]
        actual = float(probs[t, ids[t + 1]]) if t + 1 < len(ids) else None
        positions.append({"token": names[t], "top": choices, "next_actual": actual})
    return {"checkpoint": str(ckpt.path), "tokens": names, "positions": positions}


def _what(ckpt: Checkpoint) -> str:
    head = ckpt.config.head.task
    return f"arch {ckpt.config.model.arch!r}" + ("" if head == "none" else f" with a {head!r} head")


def stream(ckpt: Checkpoint, prompt: str, settings: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Generate from ``prompt`` with ``generate``: an iterator of each new token with its
    probability under the model (softmax of the logits at temperature 1), as it is made.
    The checkpoint, prompt and settings are checked before it is returned."""
    _check_text_model(ckpt)
    if ckpt.config.model.arch != "decoder" or ckpt.config.head.task != "none":
        raise UsageError(f"playground: this checkpoint is {_what(ckpt)}; expected a decoder language model")
    return _tokens(ckpt, encode(ckpt, prompt), sampling(settings))


def _tokens(ckpt: Checkpoint, ids: list[int], options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``generate`` in a thread; its tokens, with their probabilities, as they come."""
    made: list[int] = []
    done = threading.Event()
    failure: list[BaseException] = []
    lock = threading.Condition()

    def on_token(row: int, token: int) -> None:
        with lock:
            made.append(token)
            lock.notify()

    def work() -> None:
        try:
            generate(ckpt.model, [ids], on_token=on_token, eos_id=ckpt.tokenizer.eos_id, **options)
        except BaseException as e:  # noqa: BLE001 - reported to the page, not raised in a thread
            failure.append(e)
        finally:
            done.set()
            with lock:
                lock.notify()

    threading.Thread(target=work, daemon=True, name="view-generate").start()
    sent = 0
    while True:
        with lock:
            lock.wait_for(lambda: len(made) > sent or done.is_set(), timeout=5)
            new = made[sent:]
        if new:
            for token, prob in zip(new, _probabilities(ckpt, ids + made[:sent], new)):
                yield {"id": token, "token": token_names(ckpt, [token])[0], "prob": prob if prob == prob else None}
            sent += len(new)
        elif done.is_set():
            break
    if failure:
        error = failure[0]
        yield {"error": " ".join(str(error).split()) or type(error).__name__}


def _probabilities(ckpt: Checkpoint, context: list[int], new: list[int]) -> list[float]:
    """The model's probability of each of ``new`` after ``context`` and the ones before it,
    from one forward over (the last ``max_seq_len`` tokens of) the sequence."""
    window = ckpt.config.model.max_seq_len
    seq = (context + new)[-(window + 1):]
    with torch.no_grad():
        logp = ckpt.model(torch.tensor([seq[:-1]]))[0].float().log_softmax(-1)  # (T, V)
    n = min(len(new), len(seq) - 1)
    targets = torch.tensor(seq[-n:])
    rows = logp[-n:].gather(1, targets[:, None])[:, 0].exp().tolist()
    return [float("nan")] * (len(new) - n) + rows


def sampling(settings: dict[str, Any]) -> dict[str, Any]:
    """``generate``'s keyword arguments from the page's settings, checked."""
    def number(name: str, kind: Callable, low: float, high: float, default: Any) -> Any:
        value = settings.get(name, default)
        if value is None or value == "":
            return default
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise UsageError(f"{name}: {value!r}; expected a number from {low} to {high}") from None
        if not low <= value <= high:
            raise UsageError(f"{name}: {value}; expected a number from {low} to {high}")
        return value

    temperature = number("temperature", float, 0.0, 10.0, 1.0)
    top_k = number("top_k", int, 0, 100_000, 0)
    top_p = number("top_p", float, 0.0, 1.0, 1.0)
    return {"max_new_tokens": number("max_new_tokens", int, 1, MAX_NEW_TOKENS, 100),
            "temperature": temperature, "do_sample": temperature > 0,
            "top_k": top_k or None, "top_p": top_p if 0 < top_p < 1 else None,
            "seed": number("seed", int, 0, 2**31 - 1, 0)}
