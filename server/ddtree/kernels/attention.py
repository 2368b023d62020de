"""Tree attention over a static cache: committed rows [0, start), then the new rows [start, start + n).

Every query row sees all committed rows and the new rows that `visible` [n, n] allows (the tree's
ancestors, a causal prefill, or all of a draft block); an optional sliding window hides keys `window` or
more positions behind the query (query t sits at position start + t). Queries come grouped by K/V head,
[kv, groups * n, d] (row = group * n + t), so each K/V row is read once per K/V head.

On CUDA a Triton split-K kernel (flash decoding) reads only the rows [0, start + n) (not the cache's
whole capacity) and spreads them over enough programs to fill the GPU, even for a single query row; a
second kernel (kernels/split_merge.py) merges the splits straight into the [n, H * d] layout the output
projection reads. With one split there is nothing to merge: the split kernel normalises and writes that
layout itself (one launch, and no float32 partials through global memory). Past a single query row the
kernel reads the committed keys in a loop of their own, which needs no visibility and so pipelines, then the
new rows' keys. `start` stays on the device, so a CUDA graph replays the same launch as the cache grows.
Elsewhere the same function is PyTorch's SDPA with an additive mask over the whole capacity (the CPU
reference).

A mask may carry per-head sink logits (a drafter's `attention_sink_bias`): a key every query sees, with no
value, so each softmax also spans exp(sink). The kernels fold it into the softmax's normaliser when they
finish a row; the CPU reference appends it as a column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.kernels.jit import after_previous, launch_fitting, probe, sm_count, triton_works
from ddtree.kernels.paged_attention import PagedMask, paged_attention, sink_attention
from ddtree.kernels.split_merge import merge_splits, partials
from ddtree.kernels.wgmma import early_pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the SDPA path below
    triton = None


@dataclass(frozen=True)
class TreeMask:
    """Who sees what in one forward pass, prepared once for all its layers: the Triton kernel takes the
    [n, n] visibility itself (int8), SDPA an additive mask over the whole capacity."""

    start: torch.Tensor
    n: int
    window: int | None
    visible: torch.Tensor | None = None
    additive: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # float32 [H]: per query head (K/V head * groups + group), or None


def tree_mask(start: torch.Tensor, visible: torch.Tensor, capacity: int, groups: int, head_dim: int,
              dtype: torch.dtype, window: int | None = None) -> TreeMask:
    """The rule above for `visible` [n, n] (bool), in the form the attention backend for this device takes."""
    n = visible.shape[0]
    if head_dim >= 16 and head_dim & (head_dim - 1) == 0 and triton_works(visible.device):
        # bool is one byte: no copy, unless `visible` is a view (a later prompt chunk's rows of the whole
        # prompt's mask), whose rows the kernel would read at the wrong stride
        return TreeMask(start, n, window, visible=visible.contiguous().view(torch.int8))
    columns = torch.arange(capacity, device=visible.device)
    rel = columns - start
    new = visible.index_select(1, rel.clamp(0, n - 1)) & (rel >= 0) & (rel < n)
    allowed = (rel < 0) | new
    if window is not None:
        query_pos = start + torch.arange(n, device=visible.device)
        allowed = allowed & (query_pos[:, None] - columns[None, :] < window)
    additive = torch.zeros(allowed.shape, dtype=dtype, device=visible.device)
    additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    return TreeMask(start, n, window, additive=additive.repeat(groups, 1)[None, None])


def tree_attention(q: torch.Tensor, cache: torch.Tensor, mask: TreeMask | PagedMask) -> torch.Tensor:
    """Grouped queries q [kv, groups*n, d] over cache [2, kv, T, d] -> [n, H*d] (H = kv * groups); a batch of
    sequences over a paged cache when the mask is a PagedMask (paged_attention.py)."""
    if isinstance(mask, PagedMask):
        return paged_attention(q, cache, mask)
    kv_heads, rows, d = q.shape
    n = mask.n
    if mask.visible is not None:
        return _triton_attention(q, cache, mask)
    if mask.sinks is None:
        out = F.scaled_dot_product_attention(q[None], cache[0][None], cache[1][None], attn_mask=mask.additive)[0]
    else:
        out = sink_attention(q, cache, mask.additive[0, 0], mask.sinks.view(kv_heads, -1).repeat_interleave(n, 1))
    return out.view(kv_heads, rows // n, n, d).permute(2, 0, 1, 3).reshape(n, kv_heads * rows // n * d)


def launch_config(rows: int, capacity: int, kv_heads: int, sms: int, head_dim: int = 128) -> dict[str, int]:
    """Tile height and width, key-range splits, pipeline depth and loop form for `rows` grouped query rows per
    K/V head.

    From benchmarks/kernel_tune.py --sweep on an H200 (8 K/V heads, d 128, 560-token context): one AR row
    wants many splits to fill the GPU, and one loop over its few keys; a draft block or a small tree (up to
    128 rows), short and narrow tiles over 4 splits; trees up to 256 nodes, 64-row tiles over 3 splits.
    Past a single row the committed keys get a loop of their own, without the visibility reads, which
    pipelines (12.9 against 16.3 µs a layer at 260 rows). At head dim 128 every block past a single row does
    better still with the new rows' keys in a split of their own (`--new-split`: 10.4 against 11.8 µs at 260
    rows, 9.3 against 9.7 at 132 over 4 splits, 16.0 against 17.9 at 516, 7.4 against 8.5 for a draft block's
    64; more splits lost). At head dim 256 (Qwen3.5/3.6) the trees' key
    tiles are half as wide and three deep (17.3 against 22.9 µs at 390 rows, 4 K/V heads). Larger blocks
    (prompt chunks): wide tiles and one split (no merge: their query rows already make enough programs), in
    one loop.
    """
    if rows <= 16:
        block_m, block_n, splits, stages, two_loops = 16, 64, triton.cdiv(2 * sms, kv_heads), 2, 0
    elif rows <= 128 and head_dim > 128:
        block_m, block_n, splits, stages, two_loops = 16, 32, 4, 3, 1
    elif rows <= 128:
        block_m, block_n, splits, stages, two_loops = 16, 64, 4, 3, 2
    elif rows <= 1024 and head_dim > 128:
        block_m, block_n, splits, stages, two_loops = 64, 32, 3, 3, 1
    elif rows <= 384:
        block_m, block_n, splits, stages, two_loops = 64, 64, 4 if rows <= 192 else 3, 3, 2
    elif rows <= 1024:
        block_m, block_n, splits, stages, two_loops = 64, 32, 3, 3, 2
    else:
        block_m, block_n, splits, stages, two_loops = 16, 128, 1, 2, 0
    return dict(block_m=block_m, block_n=block_n, splits=max(1, min(splits, triton.cdiv(capacity, 64), 64)),
                num_warps=4, num_stages=stages, two_loops=two_loops)


def _triton_attention(q: torch.Tensor, cache: torch.Tensor, mask: TreeMask,
                      config: dict[str, int] | None = None) -> torch.Tensor:
    kv_heads, rows, d = q.shape
    n, capacity = mask.n, cache.shape[2]
    cfg = config
    if cfg is None:
        cfg = launch_config(rows, capacity, kv_heads, sm_count(q.device), d)
    splits = cfg["splits"]
    two_loops = min(cfg["two_loops"], 1 if splits == 1 else 2)  # one split holds every key
    out = torch.empty((n, kv_heads * (rows // n) * d), dtype=q.dtype, device=q.device)
    direct = splits == 1
    if direct:  # the split kernel writes `out` itself; Acc and Stats are never touched
        acc = stats = out
    else:
        acc, stats = partials(splits, kv_heads, rows, d, q.device)
    k, v = cache[0], cache[1]
    sinks = mask.sinks if mask.sinks is not None else out  # (not read without sinks)
    order = early_pdl(q.device, n, "attention")

    def launch(tiles: dict[str, int]) -> None:
        _split_kernel[(kv_heads, triton.cdiv(rows, cfg["block_m"]), splits)](
            q, k, v, mask.visible, mask.start, acc, stats, out, sinks,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            rows, n, rows // n, 1.0 / math.sqrt(d), splits,
            WINDOW=mask.window or 0, HEAD_DIM=d, BLOCK_M=cfg["block_m"], BLOCK_N=tiles["block_n"],
            IEEE=q.dtype == torch.float32, DIRECT=direct, TWO_LOOPS=two_loops, SINK=mask.sinks is not None,
            PDL=order, num_warps=cfg["num_warps"], num_stages=tiles["num_stages"], launch_pdl=order > 0)

    # the tuned tiles fit an H200 at head dim 128 in either dtype; head dim 256 in float32 (a Qwen3.5/3.6
    # target's prompt chunk) needs narrower key tiles. The fit is kept per kernel build: the loop form and
    # the direct store are part of it.
    launch_fitting(launch, {"num_stages": cfg["num_stages"], "block_n": cfg["block_n"]}, ("block_n", 16),
                   ("attention", d, q.dtype, q.device, cfg["block_m"], two_loops, direct))
    if direct:
        return out
    merge_splits(acc, stats, out, mask.sinks, n, order)
    return out


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """Matrix product; exact float32 (no TF32) when the model runs in float32, as the reference does."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _attend(q, k_rows, v_rows, stride_kt, stride_vt, cols, in_range, allowed, start, t, acc, m_i, l_i, scale,
                WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
        """One key block `cols` into the running softmax (acc, m_i, l_i) of the query rows, where `allowed`."""
        dims = tl.arange(0, HEAD_DIM)
        k = tl.load(k_rows + cols[:, None] * stride_kt + dims[None, :], mask=in_range[:, None], other=0.0)
        s = _dot(q, tl.trans(k), IEEE) * scale
        if WINDOW > 0:
            allowed = allowed & ((start + t)[:, None] - cols[None, :] < WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_rows + cols[:, None] * stride_vt + dims[None, :], mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        return acc, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _split_kernel(Q, K, V, Vis, Start, Acc, Stats, Out, Sinks, stride_qh, stride_qr, stride_kh, stride_kt,
                      stride_vh, stride_vt, rows, n, groups, scale, SPLITS, WINDOW: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                      DIRECT: tl.constexpr, TWO_LOOPS: tl.constexpr, SINK: tl.constexpr, PDL: tl.constexpr):
        """One (K/V head, block of query rows, split of the key range): unnormalised output and softmax stats
        for split_merge.merge_splits, or, when DIRECT (one split, the whole key range), the finished output in its
        layout.
        TWO_LOOPS: the committed keys in a loop without visibility reads, then the new rows' keys; 2: the new
        rows' keys in the last split alone, the committed keys evenly over the others. SINK: each query head's
        sink logit joins the softmax when the output is finished (here when DIRECT, else in the merge)."""
        after_previous(PDL)
        head, m_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(Start).to(tl.int32)
        total = start + n
        if TWO_LOOPS == 2:  # (never with one split: _triton_attention)
            chunk = tl.cdiv(tl.cdiv(start, SPLITS - 1), BLOCK_N) * BLOCK_N
            lo = tl.where(split == SPLITS - 1, start, split * chunk)
            hi = tl.where(split == SPLITS - 1, total, tl.minimum(lo + chunk, start))
        else:
            chunk = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, total)
        r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        t = r % n  # the query's token among the new rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + head * stride_qh + r[:, None] * stride_qr + dims[None, :], mask=(r < rows)[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        k_rows, v_rows = K + head * stride_kh, V + head * stride_vh
        if TWO_LOOPS:
            # committed keys first: every row sees them (no visibility to read), then the new rows' keys
            committed_hi = tl.minimum(hi, start)
            for j0 in range(lo, committed_hi, BLOCK_N):
                cols = j0 + tl.arange(0, BLOCK_N)
                in_range = cols < committed_hi
                allowed = tl.broadcast_to(in_range[None, :], (BLOCK_M, BLOCK_N))
                acc, m_i, l_i = _attend(q, k_rows, v_rows, stride_kt, stride_vt, cols, in_range, allowed, start, t,
                                        acc, m_i, l_i, scale, WINDOW, HEAD_DIM, IEEE)
            lo = tl.maximum(lo, start)
        for j0 in range(lo, hi, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            in_range = cols < hi
            rel = cols - start
            is_new = (rel >= 0) & in_range
            vis = tl.load(Vis + t[:, None] * n + rel[None, :], mask=is_new[None, :] & (r < rows)[:, None], other=0)
            allowed = ((rel < 0)[None, :] | (vis != 0)) & in_range[None, :]
            acc, m_i, l_i = _attend(q, k_rows, v_rows, stride_kt, stride_vt, cols, in_range, allowed, start, t,
                                    acc, m_i, l_i, scale, WINDOW, HEAD_DIM, IEEE)
        heads = tl.num_programs(0)
        if DIRECT:  # every real row sees itself, so l_i > 0; padded rows (r >= rows) are not stored
            if SINK:
                sink = tl.load(Sinks + head * groups + r // n, mask=r < rows, other=0.0)
                m_new = tl.maximum(m_i, sink)
                alpha = tl.exp(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha + tl.exp(sink - m_new)
            dst = t * (heads * groups * HEAD_DIM) + (head * groups + r // n) * HEAD_DIM
            tl.store(Out + dst[:, None] + dims[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty),
                     mask=(r < rows)[:, None])
        else:
            out = (split * heads + head) * rows + r
            tl.store(Acc + out[:, None] * HEAD_DIM + dims[None, :], acc, mask=(r < rows)[:, None])
            tl.store(Stats + out, m_i, mask=r < rows)
            tl.store(Stats + SPLITS * heads * rows + out, l_i, mask=r < rows)


@probe
def _smoke_test(device: torch.device) -> None:
    """A 2-row tree over an empty cache, in both loop forms: one split writes the output itself, two go through
    the merge."""
    start = torch.zeros((), dtype=torch.long, device=device)
    mask = TreeMask(start, 2, None, visible=torch.ones(2, 2, dtype=torch.int8, device=device))
    q, cache = torch.zeros(1, 2, 16, device=device), torch.zeros(2, 1, 128, 16, device=device)
    for splits, two_loops in ((1, 0), (2, 1)):
        _triton_attention(q, cache, mask, dict(block_m=16, block_n=64, splits=splits, num_warps=4, num_stages=2,
                                               two_loops=two_loops))
