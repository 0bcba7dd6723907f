"""Which sequences run in the next model step, and how many tokens each feeds.

Iteration-level scheduling (Orca, Yu et al. 2022): requests join and leave between steps.
Each step has a token budget (``max_num_batched_tokens``) and a cap on running sequences
(``max_running``). Running decodes come first, one token each, oldest first; what is left
of the budget goes to prefill, a chunk at a time (chunked prefill: a long prompt is fed over
several steps, so running decodes keep their pace), first to sequences already part-way
through their prompt, then to waiting ones in arrival order. When the pool has no block
for a running sequence's next token, the youngest running sequence is preempted: its
blocks are released and it waits again at the front of the queue, to be recomputed from
its prompt and the tokens it already made (vLLM's recompute preemption). Nothing fails
and no token changes: the recomputed keys are the same keys.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .blocks import BlockManager, BlockTable
from .params import SamplingParams


@dataclass(eq=False)  # compared by identity: `seq in running` must not compare fields
class Sequence:
    """A request as the engine sees it. ``tokens`` is the prompt followed by the tokens
    made so far; the first ``n_computed`` of them hold keys and values in the pool."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival: int  # order of arrival: the youngest has the largest
    source: list[int] | None = None  # an encoder-decoder's source ids
    tokens: list[int] = field(default_factory=list)
    n_computed: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    cross: tuple | None = None  # an encoder-decoder's cross-attention keys and values, once computed
    memory_mask: torch.Tensor | None = None
    cached_tokens: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def n_pending(self) -> int:
        """Tokens to feed before the next one can be chosen."""
        return len(self.tokens) - self.n_computed


@dataclass
class ScheduledStep:
    decodes: list[Sequence]  # one token each
    prefills: list[tuple[Sequence, int]]  # (sequence, tokens fed this step)
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_running: int,
                 prefill_chunk: int | None = None) -> None:
        self.blocks = blocks
        self.budget, self.max_running = max_num_batched_tokens, max_running
        self.prefill_chunk = prefill_chunk or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.preempted_total = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """A sequence ends (finished or cancelled): its blocks go back at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep([], [], [])
        budget = self.budget
        for decoding in (True, False):  # decodes first: a token each keeps them at their pace
            for seq in [s for s in self.running if (s.n_pending == 1) == decoding]:
                if budget <= 0:
                    break
                if seq not in self.running:  # preempted for an older one this step
                    continue
                budget -= self._grow_or_preempt(seq, min(seq.n_pending, budget, self.prefill_chunk), step)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq.table, seq.tokens)
            seq.n_computed = cached
            n = min(seq.n_pending, budget, self.prefill_chunk)
            if not self.blocks.grow(seq.table, seq.n_computed + n):
                self.blocks.release(seq.table)  # no room now: it keeps its place, and holds nothing
                self.blocks.unmatch(len(seq.tokens), cached)
                seq.n_computed = 0
                break
            seq.cached_tokens = max(seq.cached_tokens, cached)
            step.prefills.append((seq, n))
            self.waiting.popleft()
            self.running.append(seq)
            budget -= n
        return step

    def _grow_or_preempt(self, seq: Sequence, n: int, step: ScheduledStep) -> int:
        """Blocks for ``n`` more tokens of a running sequence, preempting the youngest
        running sequences until they fit (or ``seq`` itself was the youngest); returns the
        tokens scheduled."""
        while not self.blocks.grow(seq.table, seq.n_computed + n):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return 0
        if seq.n_pending == 1:
            step.decodes.append(seq)
        else:
            step.prefills.append((seq, n))
        return n

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        if seq in step.decodes:
            step.decodes.remove(seq)
        step.prefills = [(s, n) for s, n in step.prefills if s is not seq]
        self.blocks.release(seq.table)
        seq.n_computed, seq.preemptions = 0, seq.preemptions + 1
        self.waiting.appendleft(seq)
        self.preempted_total += 1
        step.preempted.append(seq)
