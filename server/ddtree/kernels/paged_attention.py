"""Attention for a batch of sequences over a paged cache: each sequence's rows see its own committed slots and
the new rows (a tree, a draft block, a prompt chunk) its visibility allows, and nothing of any other sequence.

The cache is one pool of slots for every sequence, [2, kv, slots, d] per layer, cut into pages of `page` slots;
a sequence's cache slot i is pool slot table[i // page] * page + i % page (ddtree.core.blocks). One forward's
rows are every sequence's new rows back to back (sequence b's rows row_offsets[b] .. row_offsets[b + 1]), its
new rows written at its cache slots start_b .. start_b + n_b - 1 before attention reads them. Queries come
grouped by K/V head, [kv, groups * N, d] (row = group * N + t), as the heads step writes them, and the output
is [N, H * d], as the output projection reads it.

On CUDA a Triton kernel takes one program per (tile of one sequence's rows, K/V head), walking the sequence's
pages through its block table; the tile list is a device tensor of fixed length, so a CUDA graph replays the
same launch for any batch that fits it. Elsewhere (and as the kernel's reference) each sequence's slots are
gathered and go through SDPA with the mask.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.kernels.jit import sm_count, triton_works
from ddtree.kernels.split_merge import merge_splits, partials
from ddtree.switches import SWITCHES

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the SDPA path below
    triton = None

BLOCK_M = 16  # query rows of one sequence a program takes (times the heads that share a K/V head)
MIN_DOT_ROWS = 16  # tl.dot's least M: a program's query rows (tile rows x groups) are padded up to it


def tile_rows(rows_per_seq: int) -> int:
    """Query rows of one sequence a program takes, for a forward whose every sequence has `rows_per_seq` rows: one
    for decode rows (a program then carries its row's heads alone, padded to MIN_DOT_ROWS, not BLOCK_M rows of
    which one is real), else BLOCK_M."""
    return 1 if rows_per_seq == 1 else BLOCK_M


def tile_count(rows: int, seqs: int, block_m: int) -> int:
    """Tiles a forward of at most `rows` rows over at most `seqs` sequences needs at most: a captured forward's
    fixed tile list (each sequence's last tile may be partial, except in one-row tiles)."""
    return rows // block_m + (seqs if block_m > 1 else 0)


@dataclass(frozen=True)
class PagedMask:
    """Who sees what in one batched forward, prepared once for all its layers. The device tensors are what the
    kernel reads; `host` holds the same layout as lists, for the SDPA path (which loops over sequences)."""

    n: int  # rows in the forward, every sequence's
    starts: torch.Tensor  # [B] int32: committed slots of each sequence (its new rows follow)
    row_offsets: torch.Tensor  # [B + 1] int32
    tables: torch.Tensor  # [B, blocks] int32 block tables (padded)
    visible: torch.Tensor  # flat int8: sequence b's [n_b, n_b] visibility at vis_offsets[b]
    vis_offsets: torch.Tensor  # [B] int32
    tiles: torch.Tensor  # [T, 2] int32: (sequence, first row) of each program's rows; sequence -1: no work
    page: int
    window: int | None
    host: PagedLayout | None = None
    sinks: torch.Tensor | None = None  # [H] float32: a layer's sink logit per query head (head * groups + group)
    block_m: int = BLOCK_M  # rows of one sequence a tile holds (`tiles` was cut by it: tile_rows)


@dataclass(frozen=True)
class PagedLayout:
    starts: list[int]
    row_offsets: list[int]
    tables: list[list[int]]
    visible: list[torch.Tensor]  # per sequence, bool [n_b, n_b]
    packed: np.ndarray | None = None  # all of them flattened and concatenated (the kernels' form), when made at once


def tiles_for(row_offsets: list[int], count: int | None = None, block_m: int = BLOCK_M) -> np.ndarray:
    """(sequence, first row) of every `block_m`-row tile of every sequence's rows, int32 [tiles, 2], padded with
    (-1, 0) to `count`."""
    per_seq = -(-np.diff(np.asarray(row_offsets, dtype=np.int64)) // block_m)
    total = int(per_seq.sum())
    if count is not None and total > count:
        raise ValueError(f"{total} tiles do not fit {count}")
    tiles = np.zeros((total if count is None else count, 2), dtype=np.int32)
    tiles[total:, 0] = -1
    seq = np.repeat(np.arange(len(per_seq)), per_seq)
    first = np.cumsum(per_seq) - per_seq  # each sequence's first tile
    tiles[:total, 0] = seq
    tiles[:total, 1] = (np.arange(total) - first[seq]) * block_m
    return tiles


def paged_mask(layout: PagedLayout, page: int, device: torch.device, window: int | None = None,
               tile_count: int | None = None, block_m: int = BLOCK_M) -> PagedMask:
    """The device form of a layout (built on the host each step; a captured step copies it into its buffers)."""
    blocks = max((len(t) for t in layout.tables), default=1) or 1
    tables = torch.zeros((len(layout.tables), blocks), dtype=torch.int32)
    for b, table in enumerate(layout.tables):
        tables[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
    flat = [v.reshape(-1).to(torch.int8) for v in layout.visible]
    vis_offsets = [0]
    for v in flat[:-1]:
        vis_offsets.append(vis_offsets[-1] + v.numel())
    as_int = dict(dtype=torch.int32, device=device)
    return PagedMask(layout.row_offsets[-1], torch.tensor(layout.starts, **as_int),
                     torch.tensor(layout.row_offsets, **as_int), tables.to(device),
                     torch.cat(flat).to(device) if flat else torch.zeros(1, dtype=torch.int8, device=device),
                     torch.tensor(vis_offsets, **as_int),
                     torch.tensor(tiles_for(layout.row_offsets, tile_count, block_m), **as_int).view(-1, 2),
                     page, window, layout, block_m=block_m)


def kernel_works(device: torch.device, head_dim: int) -> bool:
    """Whether the paged kernel runs on `device` at this head dim (its own smoke test, once per device: a build
    that fails leaves this path to SDPA, the rest of the fast path's kernels to themselves)."""
    if head_dim < 16 or head_dim & (head_dim - 1) or not triton_works(device):
        return False
    key = (device.type, device.index if device.type != "cuda" else torch.cuda.current_device())
    if key not in _WORKS:
        try:
            _smoke_test(device)
            _WORKS[key] = True
        except Exception as exc:  # a Triton that cannot build it: SDPA serves
            print(f"ddtree fast path: the paged attention kernel cannot run ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); batches attend through SDPA", file=sys.stderr)
            _WORKS[key] = False
    return _WORKS[key]


_WORKS: dict[tuple, bool] = {}


def paged_attention(q: torch.Tensor, cache: torch.Tensor, mask: PagedMask) -> torch.Tensor:
    """Grouped queries q [kv, groups*N, d] over a paged cache [2, kv, slots, d] -> [N, H*d]."""
    if kernel_works(q.device, q.shape[2]):
        return _triton_paged(q, cache, mask)
    if mask.host is None:  # a layout built on the device (fast/batch_round.py): read back, where no kernel runs
        mask = replace(mask, host=read_layout(mask))
    return paged_attention_sdpa(q, cache, mask)


def read_layout(mask: PagedMask) -> PagedLayout:
    """A mask's device layout as host lists (the SDPA path's form): every sequence's start, rows, table and
    visibility."""
    offsets, vis_offsets = mask.row_offsets.tolist(), mask.vis_offsets.tolist()
    visible = [mask.visible[at:at + (hi - lo) ** 2].view(hi - lo, hi - lo).bool().cpu()
               for at, lo, hi in zip(vis_offsets, offsets, offsets[1:], strict=False)]
    return PagedLayout(mask.starts.tolist(), offsets, mask.tables.tolist(), visible)


def paged_attention_sdpa(q: torch.Tensor, cache: torch.Tensor, mask: PagedMask) -> torch.Tensor:
    """The reference: per sequence, its slots gathered and SDPA with its mask."""
    layout = mask.host
    if layout is None:
        raise ValueError("the SDPA path needs the mask's host layout")
    kv_heads, rows, d = q.shape
    groups, n = rows // mask.n, mask.n
    grouped = q.view(kv_heads, groups, n, d)
    out = torch.empty((n, kv_heads * groups * d), dtype=q.dtype, device=q.device)
    for b, start in enumerate(layout.starts):
        lo, hi = layout.row_offsets[b], layout.row_offsets[b + 1]
        if hi == lo:
            continue
        total = start + hi - lo
        table = layout.tables[b]
        slots = torch.tensor([table[i // mask.page] * mask.page + i % mask.page for i in range(total)],
                             device=q.device)
        k, v = cache[0].index_select(1, slots), cache[1].index_select(1, slots)  # [kv, total, d]
        allowed = torch.ones((hi - lo, total), dtype=torch.bool, device=q.device)
        allowed[:, start:] = layout.visible[b].to(q.device)
        if mask.window is not None:
            query_pos = start + torch.arange(hi - lo, device=q.device)
            allowed &= query_pos[:, None] - torch.arange(total, device=q.device)[None, :] < mask.window
        additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed,
                                                                                          torch.finfo(q.dtype).min)
        rows_q = grouped[:, :, lo:hi].reshape(kv_heads, groups * (hi - lo), d)
        if mask.sinks is None:
            attended = F.scaled_dot_product_attention(rows_q[None], k[None], v[None],
                                                      attn_mask=additive.repeat(groups, 1)[None, None])[0]
        else:
            sinks = mask.sinks.view(kv_heads, groups).repeat_interleave(hi - lo, 1)  # [kv, groups * rows]
            attended = sink_attention(rows_q, torch.stack([k, v]), additive.repeat(groups, 1), sinks)
        out[lo:hi] = attended.view(kv_heads, groups, hi - lo, d).permute(2, 0, 1, 3).reshape(hi - lo, -1)
    return out


def sink_attention(q: torch.Tensor, cache: torch.Tensor, additive: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """SDPA's result with a sink column: q [kv, rows, d], additive [rows, T], sinks [kv, rows] -> [kv, rows, d]."""
    scores = (q @ cache[0].transpose(-1, -2)).float() / math.sqrt(q.shape[-1]) + additive.float()
    weights = torch.softmax(torch.cat([scores, sinks[..., None]], dim=-1), dim=-1)[..., :-1]
    return (weights.to(q.dtype) @ cache[1]).to(q.dtype)


def launch_config(rows: int, tiles: int, kv_heads: int, sms: int, page: int, head_dim: int) -> tuple[int, int]:
    """(key columns a program takes at a time, splits of each sequence's key range) for `rows` query rows over a
    tile list of `tiles` (a captured forward's is padded: one tile a sequence it may hold, at least). Decode rows
    make one tile a sequence, so 32 requests over 8 K/V heads are 256 programs, each walking thousands of slots
    alone: on an H100 the kernel read the KV of a Qwen3-8B-shaped batch of 32 at a quarter of the bandwidth
    (benchmarks/RESULTS.md). Where the rows are that thin (at most two a tile that holds any), every sequence's
    keys split over enough programs to fill the GPU four times over (at most 16 splits; split_merge merges them);
    prompt chunks and trees, whose tiles are full, do not split. Columns look their page up one by one, so a tile
    of 64 columns may span pages of any power-of-two size; tl.dot needs K >= 16 on every Triton."""
    block_n = (64 if head_dim <= 128 else 32) if page & (page - 1) == 0 else 16
    working = min(rows, tiles)  # tiles that hold a row: padding tiles end at once
    if rows > 2 * working:
        return block_n, 1
    return block_n, max(1, min(16, -(-4 * sms // (working * kv_heads))))


def _triton_paged(q: torch.Tensor, cache: torch.Tensor, mask: PagedMask, splits: int | None = None,
                  block_n: int | None = None, num_stages: int = 2) -> torch.Tensor:
    """The kernel's launch; `splits`, `block_n` and `num_stages` other than launch_config's are for sweeps."""
    kv_heads, rows, d = q.shape
    groups = rows // mask.n
    out = torch.empty((mask.n, kv_heads * groups * d), dtype=q.dtype, device=q.device)
    k, v = cache[0], cache[1]
    auto_n, auto = launch_config(mask.n, mask.tiles.shape[0], kv_heads, sm_count(q.device), mask.page, d)
    block_n = block_n or auto_n
    splits = splits or (auto if SWITCHES.paged_split else 1)
    direct = splits == 1
    acc, stats = (out, out) if direct else partials(splits, kv_heads, rows, d, q.device)
    sinks = mask.sinks if mask.sinks is not None else out  # (never read without SINK)
    _paged_kernel[(mask.tiles.shape[0], kv_heads, splits)](
        q, k, v, out, acc, stats, mask.starts, mask.row_offsets, mask.tables, mask.visible, mask.vis_offsets,
        mask.tiles, sinks, q.stride(0), q.stride(1), k.stride(0), k.stride(1), mask.tables.stride(0), mask.n,
        1.0 / math.sqrt(d), splits, PAGE=mask.page, WINDOW=mask.window or 0, GROUPS=groups, HEAD_DIM=d,
        BLOCK_M=mask.block_m, BLOCK_N=block_n, ROWS=max(MIN_DOT_ROWS, triton.next_power_of_2(mask.block_m * groups)),
        IEEE=q.dtype == torch.float32, SINK=mask.sinks is not None, DIRECT=direct, num_warps=4,
        num_stages=num_stages)
    if not direct:
        merge_splits(acc, stats, out, mask.sinks, mask.n)
    return out


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """Matrix product; exact float32 (no TF32) when the model runs in float32, as the reference does."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _paged_kernel(Q, K, V, Out, Acc, Stats, Starts, Offsets, Tables, Vis, VisOffsets, Tiles, Sinks, stride_qh,
                      stride_qr, stride_kh, stride_kt, stride_table, n_total, scale, SPLITS, PAGE: tl.constexpr,
                      WINDOW: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, ROWS: tl.constexpr, IEEE: tl.constexpr, SINK: tl.constexpr,
                      DIRECT: tl.constexpr):
        """One tile of one sequence's query rows (every head that shares K/V head `head`), over one split of the
        sequence's committed slots and its visible new rows, in pages through its block table. DIRECT (one
        split): the finished rows, SINK adding each query head's sink logit to the softmax's normaliser (a column
        no value reads); else the split's unnormalised rows and softmax stats for split_merge, which adds it."""
        tile, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq = tl.load(Tiles + 2 * tile)
        if seq >= 0:
            first = tl.load(Tiles + 2 * tile + 1)
            row0 = tl.load(Offsets + seq)
            n = tl.load(Offsets + seq + 1) - row0
            start = tl.load(Starts + seq)
            vis_base = tl.load(VisOffsets + seq)
            r = tl.arange(0, ROWS)  # (row, group) pairs, padded to a power of two
            t = first + r // GROUPS  # the row within the sequence's new rows
            group = r % GROUPS
            row_ok = (r < BLOCK_M * GROUPS) & (t < n)
            dims = tl.arange(0, HEAD_DIM)
            q_rows = group * n_total + row0 + t
            q = tl.load(Q + head * stride_qh + q_rows[:, None] * stride_qr + dims[None, :], mask=row_ok[:, None],
                        other=0.0)
            m_i = tl.full((ROWS,), float("-inf"), tl.float32)
            l_i = tl.zeros((ROWS,), tl.float32)
            acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
            total = start + n
            chunk = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, total)
            for j0 in range(lo, hi, BLOCK_N):
                cols = j0 + tl.arange(0, BLOCK_N)
                in_range = cols < hi
                page = tl.load(Tables + seq * stride_table + cols // PAGE, mask=in_range, other=0)
                slots = page * PAGE + cols % PAGE
                k = tl.load(K + head * stride_kh + slots[:, None] * stride_kt + dims[None, :], mask=in_range[:, None],
                            other=0.0)
                s = _dot(q, tl.trans(k), IEEE) * scale
                rel = cols - start
                is_new = (rel >= 0) & in_range
                vis = tl.load(Vis + vis_base + t[:, None] * n + rel[None, :], mask=is_new[None, :] & row_ok[:, None],
                              other=0)
                allowed = ((rel < 0)[None, :] | (vis != 0)) & in_range[None, :]
                if WINDOW > 0:
                    allowed = allowed & ((start + t)[:, None] - cols[None, :] < WINDOW)
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                v = tl.load(V + head * stride_kh + slots[:, None] * stride_kt + dims[None, :], mask=in_range[:, None],
                            other=0.0)
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
                m_i = m_new
                l_i = l_i * alpha + tl.sum(p, 1)
            heads = tl.num_programs(1)
            if DIRECT:
                if SINK:
                    sink = tl.load(Sinks + head * GROUPS + group)
                    m_new = tl.maximum(m_i, sink)
                    alpha = tl.exp(m_i - m_new)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha + tl.exp(sink - m_new)
                dst = (row0 + t) * (heads * GROUPS * HEAD_DIM) + (head * GROUPS + group) * HEAD_DIM
                l_safe = tl.where(l_i > 0, l_i, 1.0)
                tl.store(Out + dst[:, None] + dims[None, :], (acc / l_safe[:, None]).to(Out.dtype.element_ty),
                         mask=row_ok[:, None])
            else:  # split_merge's layout: [splits, kv, rows] with row = group * n_total + token
                rows = GROUPS * n_total
                part = (split * heads + head) * rows + q_rows
                tl.store(Acc + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
                tl.store(Stats + part, m_i, mask=row_ok)
                tl.store(Stats + SPLITS * heads * rows + part, l_i, mask=row_ok)


def _smoke_test(device: torch.device) -> None:
    """Two sequences of one and two rows over a 2-slot page."""
    layout = PagedLayout([1, 0], [0, 1, 3], [[0], [1]], [torch.ones(1, 1, dtype=torch.bool),
                                                         torch.ones(2, 2, dtype=torch.bool).tril()])
    mask = paged_mask(layout, 2, device)
    _triton_paged(torch.zeros(1, 9, 16, device=device), torch.zeros(2, 1, 4, 16, device=device), mask)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
