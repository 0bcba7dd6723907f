"""The engine loop: requests in, one model step at a time over all of them, tokens out.

``Engine.step()`` asks the scheduler which sequences run, has the model runner compute
their logits through the paged pool, chooses each request's next token under its own
settings, and returns what each request gained: ids, settled text (stop strings held back
as ``TextStream`` does), log-probabilities, and why it finished. Requests may be added and
aborted between any two steps. ``LLM`` drives it to completion for a list of prompts, like
vLLM's ``LLM``; ``AsyncEngine`` (async_engine.py) drives it from a thread for the server.

Decoders generate; an encoder-decoder translates (its source encoded once, on the request's
first step); an encoder embeds (``embed``: pooled hidden states, no pool needed).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import UsageError
from ..generate.stream import TextStream
from ..generate.seq2seq import EXTRA_TARGET_LEN
from ..generate.step import resolve_kv_dtype
from ..models.heads import pool as pool_hidden
from ..tokenizers import BOS_ID, EOS_ID
from .blocks import BlockManager, salt_for
from .params import RequestOutput, SamplingParams
from .runner import ModelRunner, PagedPool, RowInput
from .sampler import blocked_ids, choose, logprob_of
from .scheduler import Scheduler, Sequence

DEFAULT_KV_BYTES = 512 * 2**20  # the pool's size when num_blocks is not given


class QueueFull(Exception):
    """Too many requests wait already; try again in ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: int = 1) -> None:
        super().__init__(f"{waiting} requests are waiting, the server's limit (--max-queued); retry later")
        self.retry_after = retry_after


@dataclass
class EngineStats:
    waiting: int
    running: int
    preempted_total: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    steps_total: int


class _Request:
    """A sequence with what its caller has not been sent yet."""

    def __init__(self, seq: Sequence, decode, eos_id: int | None) -> None:
        self.seq, self.eos_id = seq, eos_id
        self.pieces: list[str] = []
        self.stream = TextStream(decode, lambda row, text: self.pieces.append(text), seq.params.stop)
        self.new_ids: list[int] = []
        self.logprobs: list | None = [] if seq.params.logprobs is not None else None
        self.finish_reason: str | None = None

    def output(self) -> RequestOutput:
        seq = self.seq
        prompt = seq.prompt if seq.source is None else seq.source  # a translation's prompt is its source
        out = RequestOutput(seq.request_id, self.new_ids, "".join(self.pieces), self.logprobs,
                            self.finish_reason is not None, self.finish_reason, len(prompt),
                            seq.n_generated, seq.cached_tokens)
        self.pieces, self.new_ids = [], []
        self.logprobs = [] if self.logprobs is not None else None
        return out


class Engine:
    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_batched_tokens: int = 512,
        max_running: int = 64,
        max_queued: int = 256,
        prefix_caching: bool = True,
        model_name: str = "blockformer",
        chat_template: str | None = None,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        cfg = getattr(model, "cfg", None)
        if cfg is None:
            raise TypeError("model: expected a blockformer model (with .cfg)")
        for name, value, low in [("block_size", block_size, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                                 ("max_running", max_running, 1), ("max_queued", max_queued, 1)]:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"{name}: {value!r}; expected an integer >= {low}")
        kv_dtype = resolve_kv_dtype(kv_cache_dtype)  # None: the dtype attention computes in
        self.model, self.tokenizer, self.cfg = model.eval(), tokenizer, cfg
        self.arch, self.model_name, self.chat_template = cfg.arch, model_name, chat_template
        self.max_context = cfg.max_seq_len
        self.max_queued, self.eos_id = max_queued, EOS_ID
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(seed)
        self.prompt_tokens_total = self.generation_tokens_total = self.steps_total = 0
        if self.arch == "encoder":
            self.blocks = self.scheduler = self.runner = None
            return
        if num_blocks is None:
            per_block = PagedPool.bytes_per_block(model, block_size, kv_dtype)
            num_blocks = max(-(-self.max_context // block_size) + 1, DEFAULT_KV_BYTES // per_block)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise UsageError(f"num_blocks: {num_blocks!r}; expected an integer >= 1")
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_batched_tokens, max_running)
        self.runner = ModelRunner(model, PagedPool(model, num_blocks, block_size, kv_dtype))

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, device: str = "cpu", precision: str = "fp32",
                        quantize: str | None = None, chat_template: str | None = None, **kwargs) -> Engine:
        """Load a checkpoint (a run or checkpoint directory) to serve. ``chat_template``:
        a Jinja template's text; default the checkpoint's own (``chat_template.jinja``)."""
        from ..generate import prepare_for_decoding  # noqa: PLC0415
        from ..train.load import load_checkpoint  # noqa: PLC0415

        ckpt = load_checkpoint(path, device)
        if ckpt.config.head.task != "none" and ckpt.config.model.arch != "encoder":
            raise UsageError(f"checkpoint {path}: a {ckpt.config.head.task} head; serving expects a language "
                             "model, an encoder-decoder or an encoder")
        model = prepare_for_decoding(ckpt.model, precision, quantize, pack=True)
        template = chat_template if chat_template is not None else chat_template_of(Path(path))
        kwargs.setdefault("model_name", _model_name(Path(path)))
        return cls(model, ckpt.tokenizer, chat_template=template, **kwargs)

    # --- requests ---

    def check_request(self, prompt: str | list[int], params: SamplingParams, source: bool = False) -> list[int]:
        """The prompt's token ids, checked to fit the model's context with ``max_tokens``
        (``source``: an encoder-decoder's source sentence)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params: expected a SamplingParams")
        if self.arch == "encoder":
            raise UsageError("model: an encoder; it embeds (/v1/embeddings), it does not generate")
        if (self.arch == "encoder-decoder") != source:
            raise UsageError(f"model: {'an encoder-decoder translates a source' if not source else 'a decoder'}; "
                             f"expected {'/v1/translations' if not source else 'a prompt to continue'}")
        ids = self._token_ids(prompt, "prompt")
        if source:
            ids = ids + [EOS_ID]
            limit = self.max_context
        else:
            limit = self.max_context - len(ids)
        if not ids:
            raise UsageError("prompt: empty; expected some text or token ids")
        if len(ids) > self.max_context or params.max_tokens > limit:
            raise UsageError(f"prompt: {len(ids)} tokens and max_tokens={params.max_tokens} exceed the model's context "
                             f"of {self.max_context} tokens; expected a shorter prompt or fewer max_tokens")
        n = (1 if source else len(ids)) + params.max_tokens
        if self.blocks.blocks_for(n) > self.blocks.num_blocks:
            raise UsageError(f"prompt: {n} tokens with max_tokens need {self.blocks.blocks_for(n)} KV blocks; the pool "
                             f"has {self.blocks.num_blocks} (num_blocks); expected a shorter request")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    *, source: bool = False) -> str:
        """Queue a request; return its id. Raises ``QueueFull`` past ``max_queued``
        waiting and a ``UsageError`` for a prompt that does not fit."""
        params = params or SamplingParams()
        ids = self.check_request(prompt, params, source)
        if len(self.scheduler.waiting) >= self.max_queued:
            raise QueueFull(len(self.scheduler.waiting))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise UsageError(f"request_id: {request_id!r} is already running; expected a new id")
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        generator = torch.Generator(self.runner.device).manual_seed(seed)
        src = ids if source else None
        seq = Sequence(request_id, [BOS_ID] if source else ids, params, generator, next(self._ids), source=src)
        seq.table.salt = salt_for(src)
        self.requests[request_id] = _Request(seq, self.tokenizer.decode, None if params.ignore_eos else self.eos_id)
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its blocks are free when this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req.seq)
        req.finish_reason = "abort"
        return req.output()

    def has_work(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        s, b = self.scheduler, self.blocks
        if s is None:
            return EngineStats(0, 0, 0, 0, 0, 0, 0, 0, self.prompt_tokens_total, 0, self.steps_total)
        return EngineStats(len(s.waiting), len(s.running), s.preempted_total, b.num_blocks, b.num_used, b.num_free,
                           b.queried_tokens, b.hit_tokens, self.prompt_tokens_total, self.generation_tokens_total,
                           self.steps_total)

    # --- the step ---

    def step(self) -> list[RequestOutput]:
        """One scheduled model step; the outputs of the requests that gained tokens or
        finished."""
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        self.steps_total += 1
        sizes = {id(seq): n for seq, n in plan.prefills}
        if self.arch != "encoder-decoder":  # every sequence of the step in one packed call
            seqs = plan.decodes + [seq for seq, _ in plan.prefills]
            rows = [self._row(seq, sizes.get(id(seq), 1)) for seq in seqs]
            return self._computed(seqs, rows, self.runner.run_packed(rows))
        outputs = []
        calls = [plan.decodes] if plan.decodes else []
        for seqs in self._split_first_calls(calls + _group_prefills(plan.prefills)):
            rows = [self._row(seq, sizes.get(id(seq), 1)) for seq in seqs]
            logits, view = self.runner.run(rows)
            for b, seq in enumerate(seqs):
                if seq.cross is None and rows[b].memory is not None:
                    seq.cross = ([k[b : b + 1] for k in view.cross_k], [v[b : b + 1] for v in view.cross_v])
            outputs += self._computed(seqs, rows, logits)
        return outputs

    def _computed(self, seqs: list[Sequence], rows: list[RowInput], logits: torch.Tensor) -> list[RequestOutput]:
        """The rows' keys are in the pool: commit their blocks, and advance each sequence
        whose pending tokens are all in."""
        outputs = []
        for b, seq in enumerate(seqs):
            seq.n_computed += len(rows[b].tokens)
            self.blocks.commit(seq.table, seq.tokens, seq.n_computed)
            if seq.n_computed == len(seq.tokens):
                outputs.append(self._advance(seq, logits[b]))
        return outputs

    def _split_first_calls(self, calls: list[list[Sequence]]) -> list[list[Sequence]]:
        """An encoder-decoder's first call encodes its source: alone, with its memory."""
        if self.arch != "encoder-decoder":
            return calls
        out = []
        for seqs in calls:
            first = [s for s in seqs if s.cross is None]
            rest = [s for s in seqs if s.cross is not None]
            out += [[s] for s in first] + ([rest] if rest else [])
        return out

    def _row(self, seq: Sequence, n: int) -> RowInput:
        start, stop = seq.n_computed, seq.n_computed + n
        row = RowInput(seq.tokens[start:stop], start, self.blocks.slots(seq.table, 0, start),
                       self.blocks.slots(seq.table, start, stop))
        if seq.source is not None:
            if seq.cross is None:
                src = torch.tensor([seq.source], device=self.runner.device)
                seq.memory_mask = torch.ones_like(src, dtype=torch.bool)
                with torch.inference_mode():
                    row.memory = self.model.encode(src, seq.memory_mask)
            else:
                row.cross = seq.cross
            row.memory_mask = seq.memory_mask
        return row

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> RequestOutput | None:
        """Choose the sequence's next token and see whether it ends there."""
        req, p = self.requests[seq.request_id], seq.params
        token = choose(logits, p, seq.generator, blocked_ids(p, seq.n_generated, self.eos_id))
        seq.tokens.append(token)
        self.generation_tokens_total += 1
        if token == req.eos_id or token in p.stop_token_ids:
            req.finish_reason = "stop"
        else:
            req.new_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(logprob_of(logits, token, p.logprobs))
            req.stream.on_token(0, token)
            if req.stream.stop(0, []):
                req.finish_reason = "stop"
        if req.finish_reason is None and (seq.n_generated >= p.max_tokens or len(seq.tokens) >= self.max_context):
            req.finish_reason = "length"
        if req.finish_reason is not None:
            req.stream.finish()  # what was held back as a possible stop string (a hit was cut already)
            self.scheduler.remove(seq)
            del self.requests[seq.request_id]
        return req.output()

    # --- encoders ---

    def embed(self, texts: list[str], pooling: str = "mean", normalize: bool = True) -> tuple[list[list[float]], int]:
        """Sentence vectors of an encoder: ``[bos] text [eos]`` (BERT's [CLS] ... [SEP]),
        hidden states pooled (mean over real tokens, or the first) and L2-normalised, as
        sentence-transformers does. Returns the vectors and the tokens read."""
        if self.arch != "encoder":
            raise UsageError(f"model: a {self.arch} model; embeddings need an encoder")
        if pooling not in ("mean", "cls"):
            raise UsageError(f"pooling: {pooling!r}; expected 'mean' or 'cls'")
        ids = [[BOS_ID, *self._token_ids(t, f"input[{i}]"), EOS_ID] for i, t in enumerate(texts)]
        for i, row in enumerate(ids):
            if len(row) > self.max_context:
                raise UsageError(f"input[{i}]: {len(row)} tokens; expected at most the model's {self.max_context}")
        T = max(len(r) for r in ids)
        tokens = torch.tensor([r + [0] * (T - len(r)) for r in ids])
        mask = torch.tensor([[True] * len(r) + [False] * (T - len(r)) for r in ids])
        with torch.inference_mode():
            h = self.model.hidden_states(tokens, attention_mask=mask).float()
            v = pool_hidden(h, mask, pooling)
            if normalize:
                v = nn.functional.normalize(v, dim=-1)
        self.prompt_tokens_total += sum(map(len, ids))
        return v.tolist(), sum(map(len, ids))

    def translate_beam(self, texts: list[str], beam_size: int, max_tokens: int | None = None) -> list[list[int]]:
        """Beam search for an encoder-decoder, outside the continuous batch (``translate``)."""
        from ..generate import translate  # noqa: PLC0415

        sources = [self._token_ids(t, f"input[{i}]") + [EOS_ID] for i, t in enumerate(texts)]
        with torch.inference_mode():
            return translate(self.model, sources, beam_size=beam_size, max_len=max_tokens)

    def _token_ids(self, prompt: str | list[int], name: str) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise UsageError(f"{name}: expected a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise UsageError(f"{name}: token id {bad[0]} is outside the vocabulary of {self.cfg.vocab_size}")
        return list(prompt)

    def default_max_tokens(self, source_len: int) -> int:
        """An encoder-decoder's default limit: the source length + 50, within the context."""
        return min(source_len + EXTRA_TARGET_LEN, self.max_context)


def _group_prefills(prefills: list[tuple[Sequence, int]], waste: float = 0.25) -> list[list[Sequence]]:
    """Prefill chunks that share one model call: similar lengths, so that padding every
    row to the longest wastes at most ``waste`` of the call (one call of 16 x 32 tokens
    runs faster than 16 calls of 32)."""
    groups: list[list[tuple[Sequence, int]]] = []
    for seq, n in sorted(prefills, key=lambda p: -p[1]):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * group[0][1] <= (1 + waste) * (sum(m for _, m in group) + n):
            group.append((seq, n))
        else:
            groups.append([(seq, n)])
    return [[seq for seq, _ in g] for g in groups]


def _model_name(path: Path) -> str:
    """What /v1/models calls a checkpoint: its run's name for ``RUN/best`` or ``RUN/step-N``."""
    path = path.absolute()
    if path.name == "best" or re.fullmatch(r"step-\d+", path.name):
        return path.parent.name
    return path.name


def chat_template_of(path: Path) -> str | None:
    """A chat template a checkpoint carries: ``chat_template.jinja`` (which
    ``convert --from-hf`` writes), or the ``chat_template`` field of a Hugging Face
    ``tokenizer_config.json``."""
    for d in (path, path / "best", path.parent):
        if (d / "chat_template.jinja").is_file():
            return (d / "chat_template.jinja").read_text()
        config = d / "tokenizer_config.json"
        if config.is_file():
            try:
                value = json.loads(config.read_text()).get("chat_template")
            except (OSError, ValueError):
                continue
            if isinstance(value, str):
                return value
    return None


class LLM:
    """Offline batch generation through the engine, like vLLM's ``LLM``: hand it many
    prompts, get every completion back, scheduled exactly as the server schedules them."""

    def __init__(self, model: nn.Module | str | Path, tokenizer=None, **engine_kwargs) -> None:
        if isinstance(model, (str, Path)):
            self.engine = Engine.from_checkpoint(model, **engine_kwargs)
        else:
            if tokenizer is None:
                raise TypeError("tokenizer: required with a model object")
            self.engine = Engine(model, tokenizer, **engine_kwargs)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One finished output per prompt, in order: all the ids, text and log-probabilities.
        Prompts are checked first; they join the queue as it has room."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise UsageError(f"params: {len(params)} for {len(prompts)} prompts; expected one each")
        source = self.engine.arch == "encoder-decoder"
        for p, sp in zip(prompts, params):
            self.engine.check_request(p, sp, source)
        todo = list(zip(prompts, params))[::-1]
        ids, parts, done = [], {}, {}
        while todo or self.engine.has_work():
            while todo and len(self.engine.scheduler.waiting) < self.engine.max_queued:
                p, sp = todo.pop()
                ids.append(self.engine.add_request(p, sp, source=source))
                parts[ids[-1]] = []
            for out in self.engine.step():
                parts[out.request_id].append(out)
                if out.finished:
                    done[out.request_id] = _joined(parts.pop(out.request_id))
        return [done[i] for i in ids]

    def embed(self, texts: list[str], pooling: str = "mean") -> list[list[float]]:
        return self.engine.embed(texts, pooling)[0]


def _joined(parts: list[RequestOutput]) -> RequestOutput:
    last = parts[-1]
    logprobs = None if last.logprobs is None else [lp for p in parts for lp in p.logprobs]
    return RequestOutput(last.request_id, [t for p in parts for t in p.token_ids], "".join(p.text for p in parts),
                         logprobs, True, last.finish_reason, last.prompt_tokens, last.completion_tokens,
                         last.cached_tokens, last.error)
