"""Paged KV memory: fixed-size blocks of cache slots, a block table per sequence, and the free list.

A sequence's cache slot i lives in block table[i // block_size], at offset i % block_size, in every layer's
pool at once (the pools are indexed by the same slots). Long and short requests share one pool: a sequence
holds only the blocks its tokens (and the rows its next round writes) need, and gives them all back when it
ends, is cancelled or is preempted.

With prefix caching (core/prefix_cache.py) a block may sit in several tables at once: a sequence whose prompt
starts with a cached prefix takes those blocks as they are (`match`) and writes only past them. A block counts its
holders; once none holds it, a registered block stays cached (free, but evicted only when nothing else is left,
least recently used first) and an unregistered one goes straight back to the free list.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ddtree.core.prefix_cache import PrefixCache


class OutOfBlocks(Exception):
    """Not enough free blocks for what was asked; nothing was allocated."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one slot")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest block first
        self._refs = [0] * num_blocks  # tables holding each block
        self.tables: dict[int, list[int]] = {}
        self.prefix = PrefixCache() if prefix_caching else None
        self._registered: dict[int, int] = {}  # per sequence: its leading blocks already registered or matched

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence could take now: free ones and cached ones no sequence holds."""
        return len(self._free) + (len(self.prefix.evictable) if self.prefix else 0)

    @property
    def usage(self) -> float:
        """The share of blocks in use, 0 to 1 (vLLM's kv_cache_usage_perc: cached blocks nobody holds are free)."""
        return 1.0 - self.free_blocks / self.num_blocks

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.block_size)

    def missing(self, seq_id: int, slots: int) -> int:
        """Blocks the sequence still needs to hold `slots` cache slots."""
        return max(0, self.blocks_for(slots) - len(self.tables.get(seq_id, ())))

    def ensure(self, seq_id: int, slots: int) -> list[int]:
        """Grow the sequence's table to hold `slots` slots; raises OutOfBlocks (allocating nothing) when the
        free list is too short. Returns the table."""
        need = self.missing(seq_id, slots)
        if need > self.free_blocks:
            raise OutOfBlocks(f"{need} blocks needed, {self.free_blocks} free")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._take())
        return table

    def _take(self) -> int:
        """A block for a table: a free one, else the least recently used cached one (evicted)."""
        if self._free:
            block = self._free.pop()
        else:
            block = next(iter(self.prefix.evictable))
            self.prefix.forget(block)
        self._refs[block] = 1
        return block

    def free(self, seq_id: int) -> None:
        """Give back every block the sequence holds (it may hold none). Its last blocks go first, so a cached
        prefix is evicted from its end."""
        self._registered.pop(seq_id, None)
        for block in reversed(self.tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self.prefix is not None and block in self.prefix.hash_of:
                self.prefix.evictable[block] = None
                continue
            if self.prefix is not None:
                self.prefix.forget(block)
            self._free.append(block)

    def match(self, seq_id: int, hashes: Sequence[bytes]) -> int:
        """A sequence with no blocks yet takes the cached blocks its context starts with (at most
        len(hashes)); returns how many. Nothing is matched without prefix caching."""
        if self.prefix is None or self.tables.get(seq_id):
            return 0
        found = self.prefix.lookup(hashes)
        for block in found:
            self._refs[block] += 1
            self.prefix.evictable.pop(block, None)
        self.prefix.touch(found)
        self.tables[seq_id] = list(found)
        self._registered[seq_id] = len(found)
        return len(found)

    def register(self, seq_id: int, hashes: Sequence[bytes]) -> None:
        """The sequence has written its first len(hashes) blocks (wholly, with the tokens they name): they
        join the cache, where no other block holds the same prefix."""
        if self.prefix is None:
            return
        table, done = self.tables.get(seq_id, []), self._registered.get(seq_id, 0)
        for i in range(done, min(len(hashes), len(table))):
            self.prefix.register(table[i], hashes[i])
        self._registered[seq_id] = max(done, min(len(hashes), len(table)))

    def reserve_checkpoint(self, seq_id: int, slots: int) -> int:
        """A checkpoint slot for a hybrid's states after the sequence's first `slots` slots (a block boundary)."""
        block = self.tables[seq_id][slots // self.block_size - 1]
        return self.prefix.reserve_checkpoint(block, lambda b: self._refs[b] > 0)

    def checkpoint(self, seq_id: int, slots: int) -> int:
        """The checkpoint a sequence's hit ends at: the states after its first `slots` slots."""
        return self.prefix.checkpoint_of[self.tables[seq_id][slots // self.block_size - 1]]

    def slots(self, seq_id: int, start: int, count: int) -> list[int]:
        """Physical slots of the sequence's cache slots start .. start + count - 1."""
        table, size = self.tables[seq_id], self.block_size
        return [table[i // size] * size + i % size for i in range(start, start + count)]

    def slots_of(self, seq_ids: Sequence[int], starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """`slots` of many sequences at once, one after another: each one's counts[r] slots from starts[r]; and the
        offsets where each sequence's begin (and the last ends)."""
        tables = [self.tables[seq_id] for seq_id in seq_ids]
        table_array = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for r, table in enumerate(tables):
            table_array[r, :len(table)] = table
        owner = np.repeat(np.arange(len(tables)), counts)
        offsets = [0, *np.cumsum(counts).tolist()]
        cells = starts[owner] + np.arange(offsets[-1]) - np.asarray(offsets[:-1], dtype=np.int64)[owner]
        size = self.block_size
        return table_array[owner, cells // size] * size + cells % size, offsets
