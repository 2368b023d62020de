"""Rows of a table picked by index on the device, in one launch that waits for the kernel before it (PDL).

A round gathers rows several times: the block's and the tree's embeddings, the rotary table's rows at the
new positions, the accepted path's tap features for the draft's context. torch's `index_select` takes a
kernel for up to 16 indices whose threads each walk every index in turn (7.7-8.5 µs for each of the draft
step's and the commit's 16-index gathers on an H200), and no torch kernel launches as a
programmatic dependent, so each also waits for the kernel before it to drain. Here one program copies one slice
of one row. `copy_pages` copies a cached prompt prefix's pages out of the paged pool the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.kernels.jit import after_previous, pdl, probe, program_block, triton_works

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: index_select
    triton = None

SLICE = 1024  # values a program copies: a 4096-wide row in four programs


def embed(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """module(ids) for a model's input embeddings [n] -> [n, H]: a plain nn.Embedding (a row lookup) through
    gather_rows; any other module (a scaled embedding, say) through its own forward."""
    if type(module) is nn.Embedding and module.max_norm is None and ids.dim() == 1:
        return gather_rows(module.weight, ids)
    return module(ids)


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table.index_select(0, index) for a 2-D table with contiguous rows and indices [n] -> [n, width]."""
    if not (triton_works(table.device) and table.dim() == 2 and table.stride(1) == 1
            and index.dim() == 1):
        return table.index_select(0, index)
    return _gather(table, index)


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """gather_rows' launch."""
    rows, width = index.numel(), table.shape[1]
    out = torch.empty((rows, width), dtype=table.dtype, device=table.device)
    if rows == 0:
        return out
    block = program_block(width, table.device, min(triton.next_power_of_2(width), SLICE))
    dependent = pdl(table.device)
    _gather_kernel[(rows, triton.cdiv(width, block))](table, index, out, width, table.stride(0), BLOCK=block,
                                                      PDL=dependent, num_warps=4, launch_pdl=dependent)
    return out


if triton is not None:

    @triton.jit
    def _gather_kernel(Table, Index, Out, width, stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One slice of output row pid 0: Table's row Index[pid 0]."""
        after_previous(PDL)  # the index (a token, a position, a path node) comes from the kernels before
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        source = tl.load(Index + row).to(tl.int64)
        ok = cols < width
        tl.store(Out + row.to(tl.int64) * width + cols, tl.load(Table + source * stride + cols, mask=ok), mask=ok)

    @triton.jit
    def _copy_pages_kernel(Source, Target, Pages, width, source_stride, target_stride, BLOCK: tl.constexpr):
        """One slice (pid 1) of page pid 0 of the list: the source's page Pages[pid 0] to the target's pid 0."""
        p, part = tl.program_id(0), tl.program_id(1)
        cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        src = Source + part.to(tl.int64) * source_stride + tl.load(Pages + p).to(tl.int64) * width
        dst = Target + part.to(tl.int64) * target_stride + p.to(tl.int64) * width
        tl.store(dst + cols, tl.load(src + cols, mask=ok), mask=ok)


def copy_pages(pool: torch.Tensor, cache: torch.Tensor, pages: torch.Tensor, page: int) -> None:
    """cache [..., T, d] rows 0 .. len(pages) * page - 1 <- the paged pool's [..., slots, d] pages `pages`, in order:
    a prefix hit's cached K/V into the single-request path's static caches. Each page is page x d contiguous values
    in every (layer, K/V, head) slice of both; one program copies one slice of one page. torch's `index_select`
    into the cache's strided view took its element-wise gather (0.54 ms for a Qwen3-8B-shaped 1,648-token prefix
    on an H100, three times the bytes' time)."""
    slices, d, n = pool.shape[:-2].numel(), pool.shape[-1], pages.numel()
    if n == 0:
        return
    width = page * d
    if not (triton_works(pool.device) and pool.is_contiguous() and cache.is_contiguous()):
        torch.index_select(pool.view(slices, -1, width), 1, pages, out=cache[..., :n * page, :].view(slices, n, width))
        return
    source, target = pool.view(slices, -1), cache.view(slices, -1)  # rows of every slice, back to back
    block = min(triton.next_power_of_2(width), 4096)
    _copy_pages_kernel[(n, slices, triton.cdiv(width, block))](source, target, pages, width, source.stride(0),
                                                              target.stride(0), BLOCK=block, num_warps=4)


@probe
def _smoke_test(device: torch.device) -> None:
    """One row gathered."""
    _gather(torch.ones(2, 8, device=device), torch.zeros(1, dtype=torch.long, device=device))
