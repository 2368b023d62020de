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
