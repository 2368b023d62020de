"""The row-gather kernel against index_select."""


import pytest
import torch
from marks import gpu, interpreted


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


def page_copy_matches(page: int, pages: list[int], device: str, heads: int = 3, d: int = 16) -> None:
    """copy_pages against the pages copied one by one: table order, every layer's K and V, rows after them kept."""
    from ddtree.kernels.gather import copy_pages

    gen = torch.Generator().manual_seed(page + len(pages))
    # [layers, K/V, heads, slots, d]
    pool = torch.randn(2, 2, heads, 8 * page, d, generator=gen).to(torch.bfloat16).to(device)
    cache = torch.randn(2, 2, heads, 5 * page, d, generator=gen).to(torch.bfloat16).to(device)
    want = cache.clone()
    for i, p in enumerate(pages):
        want[..., i * page:(i + 1) * page, :] = pool[..., p * page:(p + 1) * page, :]
    copy_pages(pool, cache, torch.tensor(pages, dtype=torch.long, device=device), page)
    assert torch.equal(cache, want)


@interpreted
@pytest.mark.parametrize(("page", "pages"), [(16, [3, 0, 5]), (4, [1]), (16, [])])
def test_the_page_copy_reads_a_cached_prefix_out_of_the_pool(kernels_on_cpu, page, pages):
    """A prefix hit's cached pages, in the order its block table lists them, land in the single path's caches
    rows 0 .. len(pages) * page - 1 of every layer's K and V, bit for bit; the rows after them stay as they were."""
    page_copy_matches(page, pages, "cpu")


@gpu
@pytest.mark.parametrize(("page", "pages", "heads", "d"),
                         [(16, [3, 0, 5, 7], 8, 128), (4, [1], 3, 16), (16, [], 8, 128)])
def test_the_page_copy_reads_a_cached_prefix_out_of_the_pool_on_a_gpu(page, pages, heads, d):
    """The same on CUDA, at a Qwen3-8B-shaped slice (8 K/V heads of 128) too."""
    page_copy_matches(page, pages, "cuda", heads, d)
