"""Compaction of the static K/V cache after a verify: the accepted path's rows move down to start...

A verify writes every tree node's K/V at rows start + node; the commit keeps the path's nodes as rows
start, start + 1, ... of every attention layer. In PyTorch that is a gather of the path's rows from the
whole [L, 2, kv, T, d] cache into a new tensor, then a scatter back: two kernels. On CUDA one Triton program
per (layer, K or V, head) reads its path rows and then writes them, in place: one launch, no temporary.

A path node sits at or below its depth (node i's source row start + path[i] >= start + i), but a row's
source can be another row's destination (path [0, 2, 5]: row 1 reads row 2, which row 2 overwrites), so each
program reads all its rows before it writes any.
"""

from __future__ import annotations

import torch

from ddtree.kernels.jit import after_previous, pdl, probe, triton_works

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch gather and scatter
    triton = None


def compact(cache: torch.Tensor, start: torch.Tensor, path: torch.Tensor) -> None:
    """cache [..., T, d] rows start + i <- rows start + path[i] for every i (path [R], start a device scalar),
    in every leading slice."""
    if (triton_works(cache.device) and cache.is_contiguous() and cache.shape[-1] & (cache.shape[-1] - 1) == 0
            and path.numel() > 0):
        compact_on_gpu(cache, start, path)
    else:
        compact_torch(cache, start, path)


def compact_on_gpu(cache: torch.Tensor, start: torch.Tensor, path: torch.Tensor) -> None:
    """`compact` as one Triton launch (a contiguous cache, a power-of-two head dim)."""
    head_dim, capacity = cache.shape[-1], cache.shape[-2]
    dependent = pdl(cache.device)
    _compact_kernel[(cache.numel() // (capacity * head_dim),)](
        cache, start, path, path.numel(), capacity * head_dim, D=head_dim, ROWS=triton.next_power_of_2(path.numel()),
        PDL=dependent, num_warps=4, launch_pdl=dependent)


def compact_torch(cache: torch.Tensor, start: torch.Tensor, path: torch.Tensor) -> None:
    """`compact` as a gather and a scatter: the CPU path, and the baseline the kernel is timed against."""
    axis = cache.dim() - 2
    dst = start + torch.arange(path.numel(), device=cache.device)
    cache.index_copy_(axis, dst, cache.index_select(axis, start + path))


if triton is not None:

    @triton.jit
    def _compact_kernel(Cache, Start, Path, rows, stride_slice, D: tl.constexpr, ROWS: tl.constexpr,
                        PDL: tl.constexpr):
        """One [T, D] slice: its path rows, all read, then written at start.."""
        after_previous(PDL)
        base = Cache + tl.program_id(0).to(tl.int64) * stride_slice
        start = tl.load(Start)
        i = tl.arange(0, ROWS)
        ok = (i < rows)[:, None]
        dims = tl.arange(0, D)[None, :]
        src = start + tl.load(Path + i, mask=i < rows, other=0)
        kept = tl.load(base + src[:, None] * D + dims, mask=ok)
        tl.debug_barrier()  # every thread's reads are done before any row is overwritten
        tl.store(base + (start + i)[:, None] * D + dims, kept, mask=ok)


@probe
def _smoke_test(device: torch.device) -> None:
    """A two-row compaction."""
    start = torch.zeros((), dtype=torch.long, device=device)
    compact_on_gpu(torch.zeros(2, 8, 16, device=device), start, torch.zeros(2, dtype=torch.long, device=device))
