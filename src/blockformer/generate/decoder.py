"""Decoder-only generation: prompts in, new token ids out.

Prompts of different lengths are left-padded and each row counts its positions from its
own first token, so every position scheme sees the positions it was trained on. With the
cache (the default) the prompt is run once (prefill) and then one token per step into a
cache allocated once for ``prompt + max_new_tokens`` slots. Tokens stay on the device:
sampling needs no host sync, and finished rows are checked every ``check_every`` steps
(every step only when a host callback needs the tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..config import ADDITIVE_POSITIONS
from ..errors import UsageError
from .batching import PAD_ID, pad_batch, positions_from_mask
from .sampling import Sampling, choose
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
    if check_every < 1:
        raise UsageError(f"check_every: {check_every}; expected an integer >= 1")
    device = model_device(model)
    tokens, mask = _prompt_batch(prompts, attention_mask, pad_id, device)
    B, P = tokens.shape
    N = max_new_tokens
    _check_length(model, int(mask.sum(dim=1).max()) + N)
    if generator is None and seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    if N == 0:
        return [[] for _ in range(B)]
    stop_tensors = [torch.as_tensor(list(s), dtype=torch.long, device=device) for s in stop_sequences if len(s)]
    host = on_token is not None or stop is not None
    can_stop = eos_id is not None or bool(stop_tensors) or stop is not None  # else: never sync early
    host_ids: list[list[int]] = [[] for _ in range(B)]
    cuts: dict[int, int] = {}  # row -> tokens kept, for rows a host callback stopped

    with eval_mode(model):  # tensors made inside: inference tensors throughout, one graph
        positions = positions_from_mask(mask)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        out = torch.full((B, N), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        eos_index = torch.tensor([eos_id if eos_id is not None else 0], device=device)
        if use_cache:
            cache, step = prepare_step(model, decode_step, B, P + N, compile=compile, compile_mode=compile_mode)
            cache_pos = torch.arange(P, device=device)
            logits = model(tokens, positions, mask, cache=cache, cache_pos=cache_pos)[:, -1]  # prefill
            cache_pos = cache_pos[-1:] + 1  # (1,): the slot the next token fills
        else:
            seq, seq_mask, seq_pos = tokens, mask, positions
            logits = model(seq, seq_pos, seq_mask)[:, -1]
        for i in range(N):
            if eos_id is not None and i < min_new_tokens:
                logits = logits.index_fill(1, eos_index, float("-inf"))
            was_done = done
            tok = torch.where(done, pad_id, choose(logits, sampling, generator))  # (B,)
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
                seq_pos = torch.cat([seq_pos, next_pos], dim=1)
                logits = model(seq, seq_pos, seq_mask)[:, -1]
            next_pos = next_pos + 1
    return _trim(out.tolist(), eos_id, stop_sequences, cuts)


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


def _prompt_batch(prompts, attention_mask, pad_id, device) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(prompts, torch.Tensor):
        if attention_mask is not None:
            raise UsageError("attention_mask: only with a tensor of prompts; lists are padded here")
        return pad_batch(prompts, left=True, pad_id=pad_id, device=device)
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


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UsageError(f"{name}: {value!r}; expected an integer >= 0")


def _check_length(model: nn.Module, length: int) -> None:
    """Absolute position tables end at ``max_seq_len``; the other schemes extrapolate."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.position in ADDITIVE_POSITIONS and length > cfg.max_seq_len:
        raise UsageError(
            f"max_new_tokens: prompt + new tokens = {length} exceeds the model's "
            f"max_seq_len={cfg.max_seq_len} ({cfg.position} positions); expected at most that"
        )
