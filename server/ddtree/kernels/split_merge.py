"""The second half of split-K attention (flash decoding): each split of the key range leaves its query rows'
unnormalised output and softmax statistics in float32, and one kernel merges them into the [n, H * d] layout the
output projection reads.

Both attention kernels split so: the tree attention over a static cache (kernels/attention.py) and the paged
attention of a batch (kernels/paged_attention.py), when too few query rows would leave the GPU mostly idle while
each program walks a long key range alone. Queries are grouped by K/V head, row r = group * n + t (t: the token);
partials are Acc [splits, kv, rows, d] and Stats [2, splits, kv, rows] (the running max, then the sum).
"""

from __future__ import annotations

import torch

from ddtree.kernels.jit import after_previous

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernels, and nothing splits
    triton = None


def partials(splits: int, kv_heads: int, rows: int, head_dim: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' float32 partials: Acc [splits, kv, rows, d] and Stats [2, splits, kv, rows]."""
    return (torch.empty((splits, kv_heads, rows, head_dim), dtype=torch.float32, device=device),
            torch.empty((2, splits, kv_heads, rows), dtype=torch.float32, device=device))


def merge_splits(acc: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None, n: int,
                 order: int = 0) -> None:
    """The softmax-weighted sum of every split into out [n, H * d]; `sinks` [H]: each query head's sink logit
    joins the normaliser; `order`: the PDL order to launch with (wgmma.early_pdl)."""
    splits, kv_heads, rows, d = acc.shape
    block_r = min(16, triton.next_power_of_2(rows))
    row_blocks = triton.cdiv(rows, block_r)
    block_d = d if kv_heads * row_blocks >= 64 else min(d, 32)  # few rows: spread the head dim over programs
    _merge_kernel[(kv_heads, row_blocks, d // block_d)](
        acc, stats, out, sinks if sinks is not None else out, rows, n, rows // n, HEAD_DIM=d, BLOCK_R=block_r,
        BLOCK_D=block_d, SPLITS=splits, SINK=sinks is not None, PDL=order, num_warps=4 if block_d == d else 1,
        launch_pdl=order > 0)


if triton is not None:

    @triton.jit
    def _merge_kernel(Acc, Stats, Out, Sinks, rows, n, groups, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, SINK: tl.constexpr, PDL: tl.constexpr):
        """Softmax-weighted sum of the splits for a block of rows and of head dims, written as
        out[t, (head * groups + group) * d + e]; SINK: the query head's sink logit joins the normaliser."""
        after_previous(PDL)
        head, r_block = tl.program_id(0), tl.program_id(1)
        heads = tl.num_programs(0)
        r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
        valid = r < rows
        dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        for s in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(Stats + (s * heads + head) * rows + r, mask=valid, other=float("-inf")))
        if SINK:
            sink = tl.load(Sinks + head * groups + r // n, mask=valid, other=0.0)
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros((BLOCK_R,), tl.float32)
        if SINK:
            total += tl.exp(sink - m)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        for s in tl.static_range(SPLITS):
            idx = (s * heads + head) * rows + r
            w = tl.exp(tl.load(Stats + idx, mask=valid, other=float("-inf")) - m)
            total += w * tl.load(Stats + SPLITS * heads * rows + idx, mask=valid, other=0.0)
            acc += w[:, None] * tl.load(Acc + idx[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
        t, group = r % n, r // n
        dst = t * (heads * groups * HEAD_DIM) + (head * groups + group) * HEAD_DIM
        total = tl.where(total > 0, total, 1.0)  # a padded row no split saw: zeros, not NaN
        tl.store(Out + dst[:, None] + dims[None, :], (acc / total[:, None]).to(Out.dtype.element_ty),
                 mask=valid[:, None])
