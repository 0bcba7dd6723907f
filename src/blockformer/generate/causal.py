"""Decoder-only generation: prompts in, new token ids out.

Prompts of different lengths are left-padded and each row counts its positions from its
own first token, so every position scheme sees the positions it was trained on. With the
cache (the default) the prompt is run once (prefill) and then one token per step into a
cache allocated once for ``prompt + max_new_tokens`` slots. A model with a fixed position
table (learned, sinusoidal) that would run past its ``max_seq_len`` instead slides a
window: each step re-encodes the last ``max_seq_len`` tokens without a cache, as nanoGPT
does, so it can continue for as long as asked. Tokens stay on the device:
sampling needs no host sync, and finished rows are checked every ``check_every`` steps
(every step only when a host callback needs the tokens).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..config import ADDITIVE_POSITIONS
from ..errors import UsageError
from ..models.decoder import DecoderModel
from ..models.checks import (
    check_callable, check_int, check_model, kind_of, check_seed, check_special_id, trusted_inputs,
)
from .batching import PAD_ID, PromptBatch, positions_from_mask, prepare_prompts
from .sampling import Sampling
from .step import decode_step, eval_mode, model_device, prepare_step, resolve_kv_dtype

OnToken = Callable[[int, int], None]  # (row, token id): called as each kept token is made
StopFn = Callable[[int, list[int]], bool]  # (row, new ids so far) -> stop this row now

MAX_NEW_TOKENS = 2**20  # beyond this a typo: the cache for it would not fit anyway


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool = True,
    min_new_tokens: int = 0,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    stop: StopFn | None = None,
    on_token: OnToken | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool = True,
    compile: bool = False,
    compile_mode: str | None = None,
    pad_id: int = PAD_ID,
    check_every: int = 16,
    kv_cache_dtype: str = "auto",
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; return the new ids per prompt.

    ``temperature == 0`` or ``do_sample=False`` is greedy. A row stops at ``eos_id`` (not
    returned; blocked for the first ``min_new_tokens``), after one of ``stop_sequences``
    (returned), or when ``stop(row, ids)`` says so (e.g. a stop string on decoded text;
    the token that triggered it is returned). ``on_token(row, id)`` streams kept tokens.
    ``prompts`` is a list of id lists, or a (B, T) tensor, left-padded if ``attention_mask``
    is given. ``seed`` / ``generator`` make sampling reproducible. ``use_cache=False``
    recomputes the whole sequence each step (a reference, not for speed). ``compile=True``
    compiles the one-token step with ``torch.compile``. ``kv_cache_dtype`` (``auto``, ``fp32``,
    ``bf16``, ``fp16``) is what the cache holds: ``auto`` the dtype attention computes in; a
    narrower one halves the cache's bytes and rounds its keys and values (``step.resolve_kv_dtype``).
    """
    sampling = Sampling(temperature, top_k, top_p, do_sample)
    _check_counts(max_new_tokens, min_new_tokens, check_every)
    kv_dtype = resolve_kv_dtype(kv_cache_dtype)
    stop_sequences = check_decoding_args(model, eos_id, pad_id, seed, generator, on_token, stop, stop_sequences)
    device = model_device(model)
    batch = prepare_prompts(prompts, attention_mask, pad_id=pad_id, vocab_size=vocab_size_of(model), device=device)
    window = position_table_window(model, int(batch.lengths.max()) + max_new_tokens)
    if window is not None:  # fixed table: slide over the last `window` tokens, re-encoded each step
        batch, use_cache = _last_columns(batch, window), False
    if generator is None and seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    if max_new_tokens == 0:
        return [[] for _ in range(batch.tokens.shape[0])]
    ending = _Ending(eos_id, stop_sequences, stop, on_token, min_new_tokens, batch.tokens.shape[0], device)
    with eval_mode(model), trusted_inputs():  # prompts checked above; inference tensors throughout
        if use_cache:
            steps = _CachedSteps(model, batch, max_new_tokens, compile, compile_mode, kv_dtype)
        else:
            steps = _RecomputedSteps(model, batch, window)
        out = _decode(steps, max_new_tokens, sampling, generator, ending, pad_id, check_every)
    return _trim(out.tolist(), eos_id, stop_sequences, ending.cuts)


def _check_counts(max_new_tokens: int, min_new_tokens: int, check_every: int) -> None:
    check_token_count("max_new_tokens", max_new_tokens)
    check_token_count("min_new_tokens", min_new_tokens)
    if min_new_tokens > max_new_tokens:
        raise UsageError(f"min_new_tokens: {min_new_tokens} exceeds max_new_tokens={max_new_tokens}; expected at "
                         "most that")
    check_int(check_every, "check_every", 1)


def _decode(steps, N: int, sampling: Sampling, generator, ending: _Ending, pad_id: int, check_every: int):
    """The loop: choose a token per row, see which rows ended, feed the tokens back.
    Returns the (B, N) tokens made, ``pad_id`` after a row ended."""
    logits = steps.logits
    B, device = logits.shape[0], logits.device
    out = torch.full((B, N), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for i in range(N):
        logits = ending.block_eos(logits, i)
        tok = torch.where(done, pad_id, sampling.choose(logits, generator))  # (B,)
        out[:, i] = tok
        done = ending.update(done, tok, out, i)
        if i == N - 1 or ending.possible and ((i + 1) % check_every == 0 or ending.host) and bool(done.all()):
            break
        logits = steps.advance(tok)
    return out


class _CachedSteps:
    """Prefill once, then one token per step into a cache of ``prompt + N`` slots."""

    def __init__(self, model: nn.Module, batch: PromptBatch, N: int, compile: bool, compile_mode: str | None,
                 kv_dtype: torch.dtype | None = None):
        B, P = batch.tokens.shape
        positions = batch.positions
        self.model = model
        self.cache, self.step = prepare_step(model, decode_step, B, P + N, compile=compile,
                                             compile_mode=compile_mode, kv_dtype=kv_dtype)
        self.logits = prefill(model, batch.tokens, positions, batch.mask, self.cache)  # (B, V)
        self.cache_pos = torch.tensor([P], device=batch.tokens.device)  # (1,): the slot the next token fills
        self.next_pos = positions[:, -1:] + 1  # (B, 1)

    def advance(self, tok: torch.Tensor) -> torch.Tensor:
        logits = self.step(self.model, tok[:, None], self.next_pos, self.cache, self.cache_pos)
        self.cache_pos, self.next_pos = self.cache_pos + 1, self.next_pos + 1
        return logits


class _RecomputedSteps:
    """No cache: each step re-encodes the whole sequence, or only its last ``window``
    tokens (their positions counted again from 0)."""

    def __init__(self, model: nn.Module, batch: PromptBatch, window: int | None):
        self.model, self.window = model, window
        self.seq, self.mask, self.pos = batch.tokens, batch.mask, batch.positions
        self.next_pos = self.pos[:, -1:] + 1  # (B, 1)
        self.logits = self._forward()

    def _forward(self) -> torch.Tensor:
        return last_logits(self.model, self.seq, attention_mask=self.mask, positions=self.pos)

    def advance(self, tok: torch.Tensor) -> torch.Tensor:
        self.seq = torch.cat([self.seq, tok[:, None]], dim=1)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        if self.window is not None and self.seq.shape[1] > self.window:
            self.seq, self.mask = self.seq[:, -self.window :], self.mask[:, -self.window :]
            self.pos = positions_from_mask(self.mask)  # the window starts again at position 0
        else:
            self.pos = torch.cat([self.pos, self.next_pos], dim=1)
        self.next_pos = self.next_pos + 1
        return self._forward()


def prefill(
    model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache
) -> torch.Tensor:
    """Write the prompt into ``cache``; the logits (B, V) after its last token. A sliding-
    window model's ring cache takes the prompt in chunks of ``slots - window + 1`` tokens, so
    no chunk overwrites a key that one of its own queries still sees."""
    P = tokens.shape[1]
    window = getattr(getattr(model, "cfg", None), "attention_window", 0)
    chunk = cache.max_len - window + 1 if window else P
    for start in range(0, P, chunk):
        part = slice(start, min(P, start + chunk))
        cache_pos = torch.arange(part.start, part.stop, device=tokens.device)
        logits = last_logits(model, tokens[:, part], positions=positions[:, part], attention_mask=mask[:, part],
                             cache=cache, cache_pos=cache_pos)
    return logits


def last_logits(model: nn.Module, tokens: torch.Tensor, **kw) -> torch.Tensor:
    """The logits (B, V) after each row's last token. A blockformer decoder projects that
    position alone onto the vocabulary, as nanoGPT's and Hugging Face's generation do: the head
    over every prompt position cost GPT-2 small a (B x P x 50257 x 768) product per prefill, 15% of
    a 16 x 16-token prompt's 32-token decode. Other modules (wrappers, test doubles) run whole."""
    if isinstance(model, DecoderModel):
        return model.head_logits(model.hidden_states(tokens, **kw)[:, -1])
    return model(tokens, **kw)[:, -1]


class _Ending:
    """When each row ends: at ``eos_id``, after one of the stop sequences, or when a host
    callback says so (``cuts``: row -> tokens kept, for those)."""

    def __init__(self, eos_id, stop_sequences, stop, on_token, min_new_tokens: int, batch_size: int, device):
        self.eos_id, self.stop, self.on_token, self.min_new_tokens = eos_id, stop, on_token, min_new_tokens
        self.eos_index = torch.tensor([eos_id if eos_id is not None else 0], device=device)
        self.sequences = [torch.as_tensor(s, dtype=torch.long, device=device) for s in stop_sequences if len(s)]
        self.host = on_token is not None or stop is not None  # a callback needs the tokens every step
        self.possible = eos_id is not None or bool(self.sequences) or stop is not None  # else: never sync early
        self.host_ids: list[list[int]] = [[] for _ in range(batch_size)]
        self.cuts: dict[int, int] = {}

    def block_eos(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        if self.eos_id is not None and i < self.min_new_tokens:
            return logits.index_fill(1, self.eos_index, float("-inf"))
        return logits

    def update(self, done: torch.Tensor, tok: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        """``done`` after step ``i`` wrote ``tok`` (B,) into ``out[:, i]``."""
        was_done = done
        if self.eos_id is not None:
            done = done | (tok == self.eos_id)
        for s in self.sequences:
            if len(s) <= i + 1:
                done = done | (out[:, i + 1 - len(s) : i + 1] == s).all(dim=1)
        if self.host:
            done = self._callbacks(tok.tolist(), was_done.tolist(), i, done)
        return done

    def _callbacks(self, tokens: list[int], was_done: list[bool], i: int, done: torch.Tensor) -> torch.Tensor:
        """Stream this step's tokens of the rows still running and ask ``stop``; one host
        sync per step."""
        stopped = []
        for row, t in enumerate(tokens):
            if was_done[row] or t == self.eos_id:
                continue
            self.host_ids[row].append(t)
            if self.on_token is not None:
                self.on_token(row, t)
            if self.stop is not None and self.stop(row, self.host_ids[row]):
                self.cuts[row] = i + 1
                stopped.append(row)
        if stopped:
            done = done.clone()
            done[stopped] = True
        return done


def _trim(rows: list[list[int]], eos_id, stop_sequences, cuts: dict[int, int]) -> list[list[int]]:
    """Cut each row before its first EOS, after its first stop sequence, or where a host
    callback stopped it, whichever comes first."""
    result = []
    for r, ids in enumerate(rows):
        end = cuts.get(r, len(ids))
        if eos_id is not None and eos_id in ids[:end]:
            end = ids.index(eos_id)
        for s in stop_sequences:
            L = len(s)
            for j in range(L, end + 1):
                if L and ids[j - L : j] == list(s):
                    end = j
                    break
        result.append(ids[:end])
    return result


def check_decoding_args(
    model, eos_id, pad_id, seed, generator, on_token, stop, stop_sequences=(), name: str = "model"
) -> list[list[int]]:
    """What ``generate`` and ``speculative_generate`` share: a decoder, special ids it knows,
    a seed or generator, callables, and stop sequences as lists of ids (returned)."""
    cfg = check_model(model, name, arch="decoder")
    vocab = cfg.vocab_size if cfg is not None else None
    if eos_id is not None:
        check_special_id(eos_id, vocab, "eos_id")
    check_special_id(pad_id, vocab, "pad_id")
    check_seed(seed)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: {kind_of(generator)}; expected a torch.Generator or None")
    check_callable(on_token, "on_token")
    check_callable(stop, "stop")
    if isinstance(stop_sequences, (str, bytes)) or not isinstance(stop_sequences, (Sequence, torch.Tensor)):
        raise TypeError(f"stop_sequences: {kind_of(stop_sequences)}; expected a list of token-id lists "
                        "(stop strings: TextStream)")
    out = []
    for i, s in enumerate(stop_sequences):
        if isinstance(s, (str, bytes, int)) or not hasattr(s, "__len__"):
            raise TypeError(f"stop_sequences[{i}]: {s!r}; expected a list of token ids (encode text with the "
                            "tokenizer)")
        ids = s.tolist() if hasattr(s, "tolist") else list(s)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise TypeError(f"stop_sequences[{i}]: expected integer token ids")
        for t in ids:
            check_special_id(t, vocab, f"stop_sequences[{i}]")
        out.append([int(t) for t in ids])
    return out


def check_token_count(name: str, value: int) -> None:
    """A number of tokens to generate: an integer in ``[0, MAX_NEW_TOKENS]``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_NEW_TOKENS:
        raise UsageError(f"{name}: {value!r}; expected an integer in [0, {MAX_NEW_TOKENS}]")


def vocab_size_of(model: nn.Module) -> int | None:
    """The model's vocabulary size; None for a model without a config (a test double)."""
    cfg = getattr(model, "cfg", None)
    return cfg.vocab_size if cfg is not None else None


def position_table_window(model: nn.Module, length: int) -> int | None:
    """The sliding window ``length`` tokens need: ``max_seq_len`` when a fixed position table
    (learned, sinusoidal) would end before them; None when everything fits or the scheme
    has no table (rope, alibi, relative, none continue past it)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.position in ADDITIVE_POSITIONS and length > cfg.max_seq_len:
        return cfg.max_seq_len
    return None


def _last_columns(batch: PromptBatch, window: int) -> PromptBatch:
    """The last ``window`` columns of a left-padded batch, less those that are padding in
    every row."""
    tokens, mask = batch.tokens[:, -window:], batch.mask[:, -window:]
    keep = mask.any(dim=0)  # columns where some row has a real token
    return PromptBatch(tokens[:, keep], mask[:, keep])
