"""Paged attention (ddtree/kernels/paged_attention.py): the Triton kernel against its SDPA reference over
random batches of sequences whose pages are scattered through one pool."""


import pytest
import torch
from ddtree.kernels.paged_attention import PagedLayout, paged_attention_sdpa, paged_mask
from marks import gpu, interpreted

# (page, committed slots and new rows per sequence, query heads per K/V head, window)
CASES = [
    (2, [(1, 1), (0, 2)], 3, None),  # the smoke test's shape: a page smaller than a tile's 16 columns
    (16, [(40, 1), (0, 19), (7, 5)], 4, None),  # a decode row, a prompt chunk over two tiles, a small tree
    (16, [(100, 9)], 2, 24),  # a sliding window reaching back into committed slots
    (32, [(0, 1), (63, 17), (5, 3), (31, 2)], 1, None),
]
# Decode rows alone (one a sequence): tiles of one row (tile_rows), its heads padded to tl.dot's 16 query rows
DECODE_CASES = [
    (16, [(40, 1), (0, 1), (77, 1)], 4, None),
    (2, [(1, 1), (6, 1)], 3, None),
    (16, [(100, 1)], 2, 24),
    (32, [(0, 1), (63, 1), (31, 1)], 8, None),
]


def random_batch(page: int, shape: list[tuple[int, int]], groups: int, seed: int):
    """Queries, a pool whose pages are handed out in shuffled order, and each sequence's random tree."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, d = 2, 16
    pages_needed = [-(-(start + n) // page) for start, n in shape]
    order = torch.randperm(sum(pages_needed) + 3, generator=gen).tolist()  # a few pages stay unused
    tables, offsets, visible = [], [0], []
    for (_, n), count in zip(shape, pages_needed, strict=True):
        tables.append([order.pop() for _ in range(count)])
        offsets.append(offsets[-1] + n)
        vis = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            vis[i] |= vis[int(torch.randint(0, i, (1,), generator=gen))]
        visible.append(vis)
    layout = PagedLayout([s for s, _ in shape], offsets, tables, visible)
    q = torch.randn(kv_heads, groups * offsets[-1], d, generator=gen)
    cache = torch.randn(2, kv_heads, (sum(pages_needed) + 3) * page, d, generator=gen)
    return layout, q, cache


def check(device: str, dtype: torch.dtype, page, shape, groups, window, sinks: bool = False,
          splits: int | None = None, block_m: int = 16) -> None:
    from dataclasses import replace

    from ddtree.kernels.paged_attention import _triton_paged

    layout, q, cache = random_batch(page, shape, groups, seed=page + len(shape))
    sink = torch.randn(q.shape[0] * groups, generator=torch.Generator().manual_seed(1)) * 2 if sinks else None
    reference = paged_mask(layout, page, torch.device("cpu"), window)
    if sink is not None:
        reference = replace(reference, sinks=sink.double())
    want = paged_attention_sdpa(q.double(), cache.double(), reference)
    mask = paged_mask(layout, page, torch.device(device), window, block_m=block_m)
    if sink is not None:
        mask = replace(mask, sinks=sink.to(device))
    got = _triton_paged(q.to(device, dtype), cache.to(device, dtype), mask, splits).double().cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (got - want).abs().max()


@gpu
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("page", "shape", "groups", "window"), CASES)
def test_paged_kernel_matches_sdpa_on_the_gpu(dtype, page, shape, groups, window, splits):
    """Every page size builds (a 2-slot page once failed to compile on Triton 3.6 and sent batches to SDPA), whole
    or with each sequence's keys split (a split may hold none of a short sequence's keys) and merged."""
    check("cuda", dtype, page, shape, groups, window, splits=splits)


@interpreted
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize(("page", "shape", "groups", "window"), CASES)
def test_paged_kernel_matches_sdpa_interpreted(page, shape, groups, window, splits):
    check("cpu", torch.float32, page, shape, groups, window, splits=splits)


@gpu
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("page", "shape", "groups", "window"), DECODE_CASES)
def test_decode_rows_in_one_row_tiles_match_sdpa_on_the_gpu(dtype, page, shape, groups, window, splits):
    check("cuda", dtype, page, shape, groups, window, splits=splits, block_m=1)


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(("page", "shape", "groups", "window"), DECODE_CASES)
def test_decode_rows_in_one_row_tiles_match_sdpa_interpreted(page, shape, groups, window, splits):
    """A program per (sequence, K/V head, split) whose query rows are one decode row's heads, padded to 16."""
    check("cpu", torch.float32, page, shape, groups, window, splits=splits, block_m=1)


@pytest.mark.parametrize(("page", "shape", "groups", "window"), CASES[1:3])
@pytest.mark.parametrize("device", ["cuda", "interpreted"])
def test_attention_sinks_join_each_query_heads_softmax(page, shape, groups, window, device, request):
    """A drafter layer's sink logit per query head: a column in every row's softmax that no value reads, on the
    GPU and interpreted, against the reference (itself held to the definition below)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        for dtype in (torch.float32, torch.bfloat16):
            for splits in (1, 3):
                check("cuda", dtype, page, shape, groups, window, sinks=True, splits=splits)
        return
    request.getfixturevalue("kernels_on_cpu")
    for splits in (1, 3):  # the sink joins the softmax where the rows are finished: in the kernel, or the merge
        check("cpu", torch.float32, page, shape, groups, window, sinks=True, splits=splits)


@pytest.mark.parametrize("sinks", [False, True])
def test_a_row_sees_only_its_own_sequence_and_ancestors(sinks):
    """The reference itself: a row's output is attention over its sequence's committed slots and its visible
    new rows, computed here slot by slot from the block table; with sinks, each query head's sink logit joins
    the softmax as a column without a value."""
    from dataclasses import replace

    layout, q, cache = random_batch(4, [(5, 3), (2, 4)], 2, seed=7)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0]) if sinks else None
    mask = paged_mask(layout, 4, torch.device("cpu"))
    got = paged_attention_sdpa(q, cache, mask if sink is None else replace(mask, sinks=sink))
    kv_heads, _, d = q.shape
    n = layout.row_offsets[-1]
    for b, start in enumerate(layout.starts):
        for t in range(layout.row_offsets[b + 1] - layout.row_offsets[b]):
            row = layout.row_offsets[b] + t
            cols = list(range(start)) + [start + j for j in range(t + 1) if layout.visible[b][t, j]]
            slots = torch.tensor([layout.tables[b][c // 4] * 4 + c % 4 for c in cols])
            for head in range(kv_heads):
                for group in range(2):
                    query = q[head, group * n + row]
                    scores = cache[0, head, slots] @ query / d ** 0.5
                    if sink is not None:
                        scores = torch.cat([scores, sink[head * 2 + group].view(1)])
                    weights = torch.softmax(scores, dim=0)[:len(slots)]
                    want = weights @ cache[1, head, slots]
                    col = (head * 2 + group) * d
                    assert torch.allclose(got[row, col:col + d], want, atol=1e-5)


@pytest.mark.parametrize("rows", [[], [1], [16], [17, 1, 40], [0, 5, 32, 33]])
def test_every_sequences_rows_are_covered_by_its_own_tiles_in_order(rows):
    """The tile list the kernel's programs take: each sequence's rows in BLOCK_M-row tiles, first rows 0, 16, ...,
    sequence by sequence, then (-1, 0) padding to the buffer's count."""
    from ddtree.kernels.paged_attention import BLOCK_M, tiles_for

    offsets = [0]
    for n in rows:
        offsets.append(offsets[-1] + n)
    expected = [(b, lo) for b, n in enumerate(rows) for lo in range(0, n, BLOCK_M)]
    assert tiles_for(offsets).tolist() == [list(t) for t in expected]
    assert tiles_for(offsets, len(expected) + 2).tolist() == [list(t) for t in expected] + [[-1, 0]] * 2
    with pytest.raises(ValueError, match="do not fit"):
        tiles_for([*offsets, offsets[-1] + 1], len(expected))
    one_row = [(b, lo) for b, n in enumerate(rows) for lo in range(n)]
    assert tiles_for(offsets, block_m=1).tolist() == [list(t) for t in one_row]


def test_decode_forwards_take_one_row_tiles_and_others_sixteen():
    from ddtree.kernels.paged_attention import BLOCK_M, tile_rows

    assert tile_rows(1) == 1
    assert tile_rows(2) == tile_rows(17) == tile_rows(33) == BLOCK_M


def test_a_decode_batch_splits_its_keys_to_fill_the_gpu_and_a_prompt_chunk_does_not():
    """Decode rows are one tile a sequence: 32 requests over 8 K/V heads on 132 SMs split each sequence's keys
    three ways (four programs an SM), also in a captured forward whose tile list is padded for 64 sequences, and
    one request sixteen ways (the most); prompt chunks and trees, sixteen rows a tile, take the single pass."""
    from ddtree.kernels.paged_attention import launch_config

    assert launch_config(32, 32, 8, 132, 16, 128) == (64, 3)
    assert launch_config(32, 32 // 16 + 64, 8, 132, 16, 128) == (64, 3)  # a graph's padded tile list
    assert launch_config(1, 1, 8, 132, 16, 128) == (64, 16)
    assert launch_config(536, 40, 8, 132, 16, 128)[1] == 1  # eight prompt chunks of 67 rows
    assert launch_config(264, 264 // 16 + 64, 8, 132, 16, 128)[1] == 1  # eight trees of 33 rows, captured
    assert launch_config(32, 32, 4, 132, 16, 256)[0] == 32  # head dim 256: narrower key tiles
    assert launch_config(32, 32, 8, 132, 12, 128)[0] == 16  # a page of no power of two
