"""The prefix cache's bookkeeping: blocks named by their whole prefix (and salt), shared by reference count,
cached after their last holder leaves, evicted least recently used; a hybrid's checkpoints go with their block."""

from ddtree.core.blocks import BlockManager
from ddtree.core.prefix_cache import block_hashes


def test_a_block_is_named_by_everything_before_it_and_its_salt():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partial last block has no name
    assert block_hashes(list(range(8)), 4) == a
    assert block_hashes([99, *range(1, 10)], 4)[1] != a[1]  # same tokens in block 1, another prefix
    assert block_hashes(list(range(10)), 4, "tenant-a") != a
    assert block_hashes(list(range(10)), 4, "tenant-a") != block_hashes(list(range(10)), 4, "tenant-b")
    assert block_hashes(list(range(10)), 4, "") != a  # an empty salt is a salt


def written(blocks: BlockManager, seq_id: int, tokens: list[int], salt: str | None = None) -> list[bytes]:
    hashes = block_hashes(tokens, blocks.block_size, salt)
    blocks.ensure(seq_id, len(tokens))
    blocks.register(seq_id, hashes)
    return hashes


def test_a_second_prompt_takes_the_cached_blocks_and_holds_them_until_it_leaves():
    blocks = BlockManager(8, 4, prefix_caching=True)
    hashes = written(blocks, 1, list(range(12)))
    first = list(blocks.tables[1])
    assert blocks.match(2, hashes[:2]) == 2 and blocks.tables[2] == first[:2]
    blocks.free(1)
    assert blocks.free_blocks == 6  # the shared two are held; the third is cached, free to evict
    assert blocks.match(3, hashes) == 3 and blocks.tables[3] == first
    blocks.free(2)
    blocks.free(3)
    assert blocks.free_blocks == 8 and blocks.usage == 0
    assert blocks.match(4, hashes) == 3  # still cached
    assert blocks.match(5, block_hashes(list(range(12)), 4, "salt")) == 0


def test_cached_blocks_are_evicted_least_recently_used_and_from_the_end_of_a_prefix():
    blocks = BlockManager(4, 4, prefix_caching=True)
    old = written(blocks, 1, list(range(8)))
    blocks.free(1)
    new = written(blocks, 2, list(range(50, 58)))
    blocks.free(2)
    blocks.ensure(3, 4)  # nothing free but cached blocks: the oldest prefix loses its last block first
    assert blocks.match(4, old) == 1 and blocks.match(5, new) == 2
    blocks.free(3)
    blocks.free(4)
    blocks.free(5)
    blocks.ensure(6, 16)  # everything evicted, nothing lost track of
    assert blocks.match(7, old) == 0 and blocks.match(8, new) == 0
    blocks.free(6)
    assert blocks.free_blocks == 4


def test_a_prefix_written_twice_is_cached_once_and_the_copy_is_freed():
    blocks = BlockManager(8, 4, prefix_caching=True)
    hashes = written(blocks, 1, list(range(8)))
    written(blocks, 2, list(range(8)))
    copy = list(blocks.tables[2])
    blocks.free(2)
    assert blocks.free_blocks == 6 and not set(copy) & set(blocks.prefix.hash_of)
    assert blocks.match(3, hashes) == 2 and blocks.tables[3] == blocks.tables[1]


def test_without_prefix_caching_nothing_is_matched_or_kept():
    blocks = BlockManager(8, 4)
    hashes = written(blocks, 1, list(range(8)))
    assert blocks.match(2, hashes) == 0
    blocks.free(1)
    assert blocks.free_blocks == 8


def test_a_hybrid_hit_ends_at_a_checkpoint_and_a_checkpoint_goes_with_its_block():
    blocks = BlockManager(8, 4, prefix_caching=True)
    blocks.prefix.keep_states(slots=2, every=2)
    tokens = list(range(16))
    blocks.ensure(1, 16)
    assert blocks.reserve_checkpoint(1, 8) is not None  # after block 1
    blocks.register(1, block_hashes(tokens, 4))
    hashes = block_hashes(tokens, 4)
    assert blocks.match(2, hashes) == 2  # four blocks cached, a checkpoint only after the second
    assert blocks.checkpoint(2, 8) == blocks.checkpoint(1, 8)
    blocks.free(1)
    blocks.free(2)
    blocks.ensure(3, 32)  # every block evicted: the checkpoint with its block
    assert not blocks.prefix.checkpoint_of
    blocks.free(3)
    assert blocks.match(4, hashes) == 0


def test_checkpoints_of_held_blocks_go_last():
    blocks = BlockManager(8, 4, prefix_caching=True)
    blocks.prefix.keep_states(slots=2, every=1)
    blocks.ensure(1, 4)
    blocks.reserve_checkpoint(1, 4)
    blocks.register(1, block_hashes([1, 2, 3, 4], 4))
    blocks.ensure(2, 4)
    blocks.reserve_checkpoint(2, 4)
    old, held = blocks.tables[1][0], blocks.tables[2][0]
    blocks.free(1)  # cached, unheld
    blocks.ensure(3, 8)
    blocks.reserve_checkpoint(3, 4)  # takes the unheld block's checkpoint, not the older held one's
    assert old not in blocks.prefix.checkpoint_of and held in blocks.prefix.checkpoint_of
    blocks.reserve_checkpoint(3, 8)  # every block held: the least recently used goes, the deepest stay
    assert set(blocks.prefix.checkpoint_of) == set(blocks.tables[3])
