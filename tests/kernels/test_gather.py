"""The row-gather kernel against index_select."""


import pytest
import torch
from marks import interpreted


@interpreted
@pytest.mark.parametrize(("rows", "width", "dtype"), [(16, 64, torch.bfloat16), (5, 7, torch.float32),
                                                      (1, 3000, torch.float32), (0, 64, torch.float32)])
def test_the_gather_kernel_equals_index_select(kernels_on_cpu, rows, width, dtype):
    """Embeddings, rotary rows and tap features go through it: any index, repeated or not, any row width (one
    slice per program on a GPU), and no rows at all."""
    from ddtree.kernels.gather import gather_rows

    gen = torch.Generator().manual_seed(rows + width)
    table = torch.randn(40, width, generator=gen).to(dtype)
    index = torch.randint(0, 40, (rows,), generator=gen)
    assert torch.equal(gather_rows(table, index), table.index_select(0, index))


@interpreted
@pytest.mark.parametrize(("page", "pages"), [(16, [3, 0, 5]), (4, [1]), (16, [])])
def test_the_page_copy_reads_a_cached_prefix_out_of_the_pool(kernels_on_cpu, page, pages):
    """A prefix hit's cached pages, in the order its block table lists them, land in the single path's caches
    rows 0 .. len(pages) * page - 1 of every layer's K and V, bit for bit; the rows after them stay as they were."""
    from ddtree.kernels.gather import copy_pages

    gen = torch.Generator().manual_seed(page + len(pages))
    pool = torch.randn(2, 2, 3, 8 * page, 16, generator=gen).to(torch.bfloat16)  # [L, K/V, heads, slots, d]
    cache = torch.randn(2, 2, 3, 5 * page, 16, generator=gen).to(torch.bfloat16)
    want = cache.clone()
    for i, p in enumerate(pages):
        want[..., i * page:(i + 1) * page, :] = pool[..., p * page:(p + 1) * page, :]
    copy_pages(pool, cache, torch.tensor(pages, dtype=torch.long), page)
    assert torch.equal(cache, want)
