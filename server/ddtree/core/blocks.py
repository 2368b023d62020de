"""Paged KV memory: fixed-size blocks of cache slots, a block table per sequence, and the free list.

A sequence's cache slot i lives in block table[i // block_size], at offset i % block_size, in every layer's
pool at once (the pools are indexed by the same slots). Long and short requests share one pool: a sequence
holds only the blocks its tokens (and the rows its next round writes) need, and gives them all back when it
ends, is cancelled or is preempted.
"""

from __future__ import annotations


class OutOfBlocks(Exception):
    """Not enough free blocks for what was asked; nothing was allocated."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one slot")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest block first
        self.tables: dict[int, list[int]] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """The share of blocks in use, 0 to 1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.block_size)

    def missing(self, seq_id: int, slots: int) -> int:
        """Blocks the sequence still needs to hold `slots` cache slots."""
        return max(0, self.blocks_for(slots) - len(self.tables.get(seq_id, ())))

    def ensure(self, seq_id: int, slots: int) -> list[int]:
        """Grow the sequence's table to hold `slots` slots; raises OutOfBlocks (allocating nothing) when the
        free list is too short. Returns the table."""
        need = self.missing(seq_id, slots)
        if need > len(self._free):
            raise OutOfBlocks(f"{need} blocks needed, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(need))
        return table

    def free(self, seq_id: int) -> None:
        """Give back every block the sequence holds (it may hold none)."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self._free.append(block)

    def slots(self, seq_id: int, start: int, count: int) -> list[int]:
        """Physical slots of the sequence's cache slots start .. start + count - 1."""
        table, size = self.tables[seq_id], self.block_size
        return [table[i // size] * size + i % size for i in range(start, start + count)]
