"""Automatic prefix caching: which full KV blocks hold which token prefixes (vLLM's, on core/blocks.py).

A full block is named by a hash chain over its tokens, h_i = H(h_{i-1}, tokens of block i), the first link
seeded with the request's `cache_salt`: two blocks share a name only when everything before them and in them
is the same (and their salt is), so K/V written for one request are exactly what another would write there.
Hashes are SHA-256, as vLLM's default, so no tenant can forge a collision with another's prefix.

A block is registered once its sequence has written it and it lies wholly inside the prompt (the rows a
sequence writes past its prompt, tree rows and draft rows, never enter the cache). A registered block that no
sequence holds stays cached; such blocks are evicted least recently used first when the free list runs dry.

Hybrid targets need more than K/V to skip a prefix: the recurrent and conv states after it. Those are kept as
`checkpoints` (slots of a state pool the backend owns) at block boundaries, every `every` blocks; a hit must then
end at a boundary whose checkpoint is still there. A checkpoint belongs to the block that ends at its boundary and
goes when that block is evicted or freed unregistered.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

_SEED = b"ddtree-prefix-cache-v1"


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The hash chain of every full block of `tokens` (a partial last block has none)."""
    parent = hashlib.sha256(_SEED + (b"\x01" + salt.encode() if salt is not None else b"\x00")).digest()
    out = []
    for lo in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", tokens[lo:lo + block_size]).tobytes()).digest()
        out.append(parent)
    return out


class PrefixCache:
    """The registry of cached blocks (hash <-> block), the LRU order of the unheld ones, and the checkpoints."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unheld cached blocks, least recently used first
        self.every = 0  # a checkpoint every this many blocks; 0: the target needs none (no recurrent layers)
        self.checkpoint_slots = 0
        self.checkpoint_of: OrderedDict[int, int] = OrderedDict()  # block -> checkpoint slot, least recent first
        self._free_checkpoints: list[int] = []

    def keep_states(self, slots: int, every: int) -> None:
        """A hybrid target: hits need a checkpoint of its states, `slots` of them at most, every `every` blocks."""
        if slots < 1 or every < 1:
            raise ValueError("a hybrid's prefix cache needs at least one checkpoint slot and interval")
        self.every, self.checkpoint_slots = every, slots
        self._free_checkpoints = list(range(slots - 1, -1, -1))

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` that can be skipped: all of them cached, and on a
        hybrid, ending at a block with a checkpoint."""
        found = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            found.append(block)
        if self.every:
            while found and found[-1] not in self.checkpoint_of:
                found.pop()
        return found

    def touch(self, blocks: Sequence[int]) -> None:
        """The blocks were hit: their checkpoints become the most recently used."""
        for block in blocks:
            if block in self.checkpoint_of:
                self.checkpoint_of.move_to_end(block)

    def register(self, block: int, h: bytes) -> bool:
        """Name a freshly written block; False when another block already holds that prefix (this one stays
        private and is freed as usual)."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h], self.hash_of[block] = block, h
        return True

    def forget(self, block: int) -> None:
        """The block goes back to the free list (evicted, or freed unregistered): its name and checkpoint go."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]
        self.evictable.pop(block, None)
        slot = self.checkpoint_of.pop(block, None)
        if slot is not None:
            self._free_checkpoints.append(slot)

    def reserve_checkpoint(self, block: int, held: Callable[[int], bool]) -> int:
        """A checkpoint slot for the states after `block`: a free one, else the least recently used one whose
        block no sequence holds (`held`), else the least recently used one. A hit restores its checkpoint in the
        step that matched it, before any checkpoint is reserved, so even a held block's checkpoint may go: the
        deepest checkpoints of a long prompt are then kept, rather than its first ones."""
        if block in self.checkpoint_of:
            return self.checkpoint_of[block]
        if not self._free_checkpoints:
            victim = next((b for b in self.checkpoint_of if not held(b)), next(iter(self.checkpoint_of)))
            self._free_checkpoints.append(self.checkpoint_of.pop(victim))
        slot = self._free_checkpoints.pop()
        self.checkpoint_of[block] = slot
        return slot
