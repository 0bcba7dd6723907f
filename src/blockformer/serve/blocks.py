"""The KV pool's bookkeeping: fixed-size blocks, block tables, prefix hashes, eviction.

The pool is ``num_blocks`` blocks of ``block_size`` token slots, allocated once (vLLM's
PagedAttention, Kwon et al. 2023). A sequence owns a block table: the ids of the blocks
holding its tokens, in order; its token ``i`` lives in slot ``i % block_size`` of block
``table[i // block_size]``. Blocks go back to the pool the moment a request ends.

Prefix caching (vLLM's automatic prefix caching): a block whose slots are all written is
keyed by a digest of its tokens chained to its prefix's digest, so equal keys mean an equal
whole prefix. A new request looks its prompt's full blocks up and takes the ones found
(reference counted: several sequences read one block), skipping their prefill. A block
nobody holds keeps its key and waits, least recently used first, until the pool needs it.
Nothing here touches a tensor: the model runner reads the tables.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class BlockTable:
    """One sequence's blocks, and how many of its first tokens hold keys and values."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # digests of its full blocks, in order
    salt: bytes = b""  # what the first digest chains to: the source, for an encoder-decoder


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}; expected both >= 1")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # never keyed; pop() takes the lowest
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced: oldest first
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.queried_tokens = self.hit_tokens = 0

    # --- what the scheduler asks ---

    @property
    def num_free(self) -> int:
        """Blocks a sequence could take now: never used, or cached and unreferenced."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def match_prefix(self, table: BlockTable, tokens: list[int]) -> int:
        """Take the cached blocks that hold a prefix of ``tokens`` into an empty ``table``;
        return how many tokens they cover. The last token is always left to compute: its
        logits choose the next token."""
        self.queried_tokens += len(tokens)
        if not self.prefix_caching:
            return 0
        parent = table.salt
        for start in range(0, len(tokens) - 1 - self.block_size + 1, self.block_size):
            key = _digest(parent, tokens[start : start + self.block_size])
            block = self.block_of.get(key)
            if block is None:
                break
            self._take(block)
            table.blocks.append(block)
            table.keys.append(key)
            parent = key
        hit = len(table.blocks) * self.block_size
        self.hit_tokens += hit
        return hit

    def unmatch(self, n_queried: int, n_hit: int) -> None:
        """Take back the counts of a lookup whose request could not start (it will look again)."""
        self.queried_tokens -= n_queried
        self.hit_tokens -= n_hit

    def grow(self, table: BlockTable, n_tokens: int) -> bool:
        """Give ``table`` blocks for ``n_tokens`` tokens in all; False (and nothing taken)
        when the pool has too few."""
        need = self.blocks_for(n_tokens) - len(table.blocks)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        table.blocks.extend(self._new_block() for _ in range(need))
        return True

    def commit(self, table: BlockTable, tokens: list[int], n_computed: int) -> None:
        """Key the blocks that ``n_computed`` written tokens have filled, so later requests
        can share them."""
        if not self.prefix_caching:
            return
        for i in range(len(table.keys), n_computed // self.block_size):
            parent = table.keys[-1] if table.keys else table.salt
            key = _digest(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            table.keys.append(key)
            block = table.blocks[i]
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key], self.key_of[block] = block, key

    def release(self, table: BlockTable) -> None:
        """Drop ``table``'s hold on its blocks (the request ended, was cancelled or was
        preempted); keyed ones stay cached until evicted."""
        for block in reversed(table.blocks):  # the deepest block is evicted first
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        table.blocks, table.keys = [], []

    def slots(self, table: BlockTable, start: int, stop: int) -> np.ndarray:
        """Pool slot of each token position in ``[start, stop)``."""
        pos = np.arange(start, stop)
        return np.asarray(table.blocks, dtype=np.int64)[pos // self.block_size] * self.block_size + pos % self.block_size

    # --- inside ---

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def _new_block(self) -> int:
        if self.free:
            block = self.free.pop()
        else:  # evict the least recently released cached block
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
        self.refs[block] = 1
        return block


def _digest(parent: bytes, tokens: list[int]) -> bytes:
    """A block's key: its tokens and its whole prefix (through the parent's key)."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def salt_for(source: list[int] | None) -> bytes:
    """The root of a sequence's key chain: empty for a decoder; the source's digest for an
    encoder-decoder, whose decoder keys depend on the source through cross-attention."""
    return b"" if source is None else _digest(b"source", source)
