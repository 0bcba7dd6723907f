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
from .batching import PAD_ID, pad_batch, positions_from_mask
from .sampling import Sampling, _choose
from ..models.checks import (
    check_callable, check_int, check_model, kind_of, check_seed, check_special_id, trusted_inputs,
)
from .step import decode_step, eval_mode, model_device, prepare_step

OnToken = Callable[[int, int], None]  # (row, token id): called as each kept token is made
StopFn = Callable[[int, list[int]], bool]  # (row, new ids so far) -> stop this row now


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
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; return the new ids per prompt.

    ``temperature == 0`` or ``do_sample=False`` is greedy. A row stops at ``eos_id`` (not
    returned; blocked for the first ``min_new_tokens``), after one of ``stop_sequences``
    (returned), or when ``stop(row, ids)`` says so (e.g. a stop string on decoded text;
    the token that triggered it is returned). ``on_token(row, id)`` streams kept tokens.
    ``prompts`` is a list of id lists, or a (B, T) tensor, left-padded if ``attention_mask``
    is given. ``seed`` / ``generator`` make sampling reproducible. ``use_cache=False``
    recomputes the whole sequence each step (a reference, not for speed). ``compile=True``
    compiles the one-token step with ``torch.compile``.
    """
    sampling = Sampling(temperature, top_k, top_p, do_sample)
    _check_count("max_new_tokens", max_new_tokens)
    _check_count("min_new_tokens", min_new_tokens)
    if min_new_tokens > max_new_tokens:
        raise UsageError(f"min_new_tokens: {min_new_tokens} exceeds max_new_tokens={max_new_tokens}; expected at "
                         "most that")
    check_int(check_every, "check_every", 1)
    stop_sequences = check_decoding_args(model, eos_id, pad_id, seed, generator, on_token, stop, stop_sequences)
    device = model_device(model)
    tokens, mask = _prompt_batch(prompts, attention_mask, pad_id, device)
    _check_prompt_ids(model, tokens, mask)
    N = max_new_tokens
    window = _window(model, int(mask.sum(dim=1).max()) + N)
    if window is not None:  # fixed table: slide over the last `window` tokens, re-encoded each step
        use_cache = False
        tokens, mask = tokens[:, -window:], mask[:, -window:]
        keep = mask.any(dim=0)  # columns where some row has a real token
        tokens, mask = tokens[:, keep], mask[:, keep]
    B, P = tokens.shape
    if generator is None and seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    if N == 0:
        return [[] for _ in range(B)]
    stop_tensors = [torch.as_tensor(list(s), dtype=torch.long, device=device) for s in stop_sequences if len(s)]
    host = on_token is not None or stop is not None
    can_stop = eos_id is not None or bool(stop_tensors) or stop is not None  # else: never sync early
    host_ids: list[list[int]] = [[] for _ in range(B)]
    cuts: dict[int, int] = {}  # row -> tokens kept, for rows a host callback stopped

    with eval_mode(model), trusted_inputs():  # prompts checked above; inference tensors throughout
        positions = positions_from_mask(mask)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        out = torch.full((B, N), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        eos_index = torch.tensor([eos_id if eos_id is not None else 0], device=device)
        if use_cache:
            cache, step = prepare_step(model, decode_step, B, P + N, compile=compile, compile_mode=compile_mode)
            logits = prefill(model, tokens, positions, mask, cache)
            cache_pos = torch.tensor([P], device=device)  # (1,): the slot the next token fills
        else:
            seq, seq_mask, seq_pos = tokens, mask, positions
            logits = model(seq, attention_mask=seq_mask, positions=seq_pos)[:, -1]
        for i in range(N):
            if eos_id is not None and i < min_new_tokens:
                logits = logits.index_fill(1, eos_index, float("-inf"))
            was_done = done
            tok = torch.where(done, pad_id, _choose(logits, sampling, generator))  # (B,)
            out[:, i] = tok
            if eos_id is not None:
                done = done | (tok == eos_id)
            for s in stop_tensors:
                if len(s) <= i + 1:
                    done = done | (out[:, i + 1 - len(s) : i + 1] == s).all(dim=1)
            if host:
                done = _host_callbacks(tok.tolist(), was_done.tolist(), eos_id, host_ids, cuts, i, on_token, stop, done)
            if i == N - 1 or can_stop and ((i + 1) % check_every == 0 or host) and bool(done.all()):
                break
            if use_cache:
                logits = step(model, tok[:, None], next_pos, cache, cache_pos)
                cache_pos = cache_pos + 1
            else:
                seq = torch.cat([seq, tok[:, None]], dim=1)
                seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], dim=1)
                if window is not None and seq.shape[1] > window:
                    seq, seq_mask = seq[:, -window:], seq_mask[:, -window:]
                    seq_pos = positions_from_mask(seq_mask)  # the window starts again at position 0
                else:
                    seq_pos = torch.cat([seq_pos, next_pos], dim=1)
                logits = model(seq, attention_mask=seq_mask, positions=seq_pos)[:, -1]
            next_pos = next_pos + 1
    return _trim(out.tolist(), eos_id, stop_sequences, cuts)


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
        logits = model(tokens[:, part], positions=positions[:, part], attention_mask=mask[:, part], cache=cache,
                       cache_pos=cache_pos)
    return logits[:, -1]


def _host_callbacks(tokens, was_done, eos_id, host_ids, cuts, i, on_token, stop, done) -> torch.Tensor:
    """Stream this step's tokens of the rows still running and ask ``stop``; one host
    sync per step."""
    stopped = []
    for row, t in enumerate(tokens):
        if was_done[row] or t == eos_id:
            continue
        host_ids[row].append(t)
        if on_token is not None:
            on_token(row, t)
        if stop is not None and stop(row, host_ids[row]):
            cuts[row] = i + 1
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


def _prompt_batch(prompts, attention_mask, pad_id, device) -> tuple[torch.Tensor, torch.Tensor]:
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: {kind_of(attention_mask)}; expected a bool tensor (batch, length)")
    if not isinstance(prompts, torch.Tensor):
        if attention_mask is not None:
            raise UsageError("attention_mask: only with a tensor of prompts; lists are padded here")
        return pad_batch(prompts, left=True, pad_id=pad_id, device=device)
    if prompts.dtype == torch.bool or prompts.is_floating_point() or prompts.is_complex():
        raise UsageError(f"prompts: dtype {prompts.dtype}; expected integer token ids (torch.long)")
    if prompts.dim() != 2 or prompts.shape[1] == 0:
        raise UsageError(f"prompts: shape {tuple(prompts.shape)}; expected a (batch, length) tensor, length >= 1")
    tokens = prompts.to(device=device, dtype=torch.long)
    if attention_mask is None:
        return tokens, torch.ones_like(tokens, dtype=torch.bool)
    mask = attention_mask.to(device=device, dtype=torch.bool)
    if mask.shape != tokens.shape:
        raise UsageError(f"attention_mask: shape {tuple(mask.shape)}; expected {tuple(tokens.shape)} like prompts")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()) or not bool(mask[:, -1].all()):
        raise UsageError("attention_mask: expected left padding (False then True in each row, >= 1 real token)")
    return tokens, mask


MAX_NEW_TOKENS = 2**20  # beyond this a typo: the cache for it would not fit anyway


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_NEW_TOKENS:
        raise UsageError(f"{name}: {value!r}; expected an integer in [0, {MAX_NEW_TOKENS}]")


def _window(model: nn.Module, length: int) -> int | None:
    """The sliding window for ``length`` tokens: ``max_seq_len`` when a fixed position table
    (learned, sinusoidal) would end before them; None when everything fits or the scheme
    has no table (rope, alibi, relative, none continue past it)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.position in ADDITIVE_POSITIONS and length > cfg.max_seq_len:
        return cfg.max_seq_len
    return None


def _check_prompt_ids(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> None:
    """Once per call: every real prompt token is an id the model knows."""
    cfg = getattr(model, "cfg", None)
    real = tokens[mask]
    if cfg is None or real.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(real))
    if low < 0 or high >= cfg.vocab_size:
        raise UsageError(f"prompts: id {low if low < 0 else high} is outside [0, {cfg.vocab_size}); expected "
                         f"ids the model knows (below vocab_size={cfg.vocab_size})")
