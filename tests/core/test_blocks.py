"""The KV block allocator: tables grow by whole blocks, nothing is half-allocated, everything comes back."""

import pytest
from ddtree.core.blocks import BlockManager, OutOfBlocks


def test_tables_grow_by_whole_blocks_and_map_slots_through_them():
    blocks = BlockManager(8, 4)
    table = blocks.ensure(1, 5)
    assert len(table) == 2 and blocks.free_blocks == 6
    assert blocks.ensure(1, 8) == table  # still two blocks
    other = blocks.ensure(2, 1)
    assert not set(other) & set(table)
    assert blocks.slots(1, 3, 3) == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    assert blocks.usage == pytest.approx(3 / 8)


def test_running_out_allocates_nothing_and_freeing_returns_every_block():
    blocks = BlockManager(4, 4)
    blocks.ensure(1, 12)
    with pytest.raises(OutOfBlocks):
        blocks.ensure(2, 8)
    assert blocks.free_blocks == 1 and 2 not in blocks.tables
    blocks.free(1)
    blocks.free(1)  # twice is harmless
    assert blocks.free_blocks == 4 and blocks.usage == 0
    assert len(blocks.ensure(2, 16)) == 4


def test_the_slots_of_many_sequences_at_once_are_each_ones_slots_in_turn():
    """A batched forward's rows: sequence after sequence, each one's slots from its start, across block boundaries
    and through tables of different lengths and block orders."""
    import numpy as np

    blocks = BlockManager(32, 4)
    for seq_id, slots in ((7, 9), (3, 30), (5, 2)):
        blocks.ensure(seq_id, slots)
    blocks.free(3)
    blocks.ensure(3, 22)  # a table that reuses freed blocks, out of order with the others
    seq_ids, starts, counts = [7, 3, 5], np.array([2, 13, 0]), np.array([7, 9, 2])
    slots, offsets = blocks.slots_of(seq_ids, starts, counts)
    expected = [slot for s, lo, n in zip(seq_ids, starts, counts, strict=True) for slot in blocks.slots(s, lo, n)]
    assert slots.tolist() == expected and offsets == [0, 7, 16, 18]
