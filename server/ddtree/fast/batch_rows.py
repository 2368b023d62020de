"""The static buffers a batched forward reads, and its replay as a CUDA graph per bucket of rows.

A captured forward (`Captured`) reads its rows (ids, positions, cache slots) and its sequences' paged layout from
`StaticRows`, filled before each replay (a drafter context forward from `ContextRows`); a batch is padded to the
next bucket (`buckets`), and padding rows write the pools' scratch slot. Where graphs are off (the CPU) the same
forward runs eagerly on the same buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from ddtree.fast.paged_hybrid import SeqRows
from ddtree.kernels.paged_attention import BLOCK_M, PagedLayout, PagedMask, tile_count, tiles_for


class StaticRows:
    """The device buffers one captured batched forward reads: its rows (ids, positions, cache slots) and the
    paged layout of its sequences, all at fixed sizes, filled before each replay. Rows past the batch's are
    padding: they write the pools' scratch slot, and their outputs are never read."""

    def __init__(self, rows: int, seqs: int, table_width: int, vis_capacity: int, scratch: int,
                 device: torch.device, conv_width: int = 0, block_m: int = BLOCK_M) -> None:
        """`block_m`: the paged attention's rows a tile (tile_rows: 1 where every sequence has one row)."""
        self.rows, self.seqs, self.scratch, self.block_m = rows, seqs, scratch, block_m
        long, i32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.ids, self.positions = torch.zeros(rows, **long), torch.zeros(rows, **long)
        self.slots = torch.full((rows,), scratch, **long)
        self.starts, self.row_offsets = torch.zeros(seqs, **i32), torch.zeros(seqs + 1, **i32)
        self.tables = torch.zeros((seqs, table_width), **i32)
        self.visible = torch.zeros(vis_capacity, dtype=torch.int8, device=device)
        self.vis_offsets = torch.zeros(seqs, **i32)
        self.tiles = torch.full((tile_count(rows, seqs, block_m), 2), -1, **i32)
        self.rule_visible: dict[tuple[int | None, bool], torch.Tensor] = {}  # a draft forward's, per layer rule
        # a hybrid verify's: each sequence's state slot and each row's conv window (fast/paged_hybrid.py)
        self.state_slots = torch.zeros(seqs, **i32)
        self.sources = torch.zeros((rows, conv_width), **long)

    def fits(self, rows: int, layout: PagedLayout) -> bool:
        tables = max((len(t) for t in layout.tables), default=0)
        return (rows <= self.rows and len(layout.starts) <= self.seqs and tables <= self.tables.shape[1]
                and sum(v.numel() for v in layout.visible) <= self.visible.numel())

    def repeat_visibility(self, block: int, rules: dict[tuple[int | None, bool], torch.Tensor]) -> None:
        """A draft forward's visibility, the same for every batch: sequence s's block of `block` rows at offset
        s * block * block in each rule's buffer (`rules`: each drafter layer rule's [block, block] matrix). Written
        once, at the capture; `fill(visible=False)` then leaves it."""
        square = block * block
        count = self.visible.numel() // square
        self.vis_offsets.copy_(torch.arange(self.seqs).clamp(max=count - 1) * square)
        for rule, buffer in self.rule_visible.items():
            buffer[:count * square].copy_(rules[rule].reshape(-1).to(torch.int8).repeat(count))

    def fill(self, ids: list[int], positions: list[int], slots: list[int], layout: PagedLayout,
             visible: bool = True) -> None:
        """The batch's rows and layout into the buffers (`visible`: also its visibility, else the buffers keep
        theirs: `repeat_visibility`), built in host arrays and copied in one go each."""
        n, seqs = len(ids), len(layout.starts)
        rows = np.empty((3, self.rows), dtype=np.int64)
        rows[:2, n:], rows[2, n:] = 0, self.scratch
        rows[0, :n], rows[1, :n], rows[2, :n] = ids, positions, slots
        per_seq = np.zeros((3, self.seqs + 1), dtype=np.int32)
        per_seq[0, :seqs] = layout.starts
        per_seq[1, :seqs + 1] = layout.row_offsets
        per_seq[1, seqs + 1:] = layout.row_offsets[-1]
        tables = np.zeros(self.tables.shape, dtype=np.int32)
        for b, table in enumerate(layout.tables):
            tables[b, :len(table)] = table
        rows_t = torch.from_numpy(rows)
        self.ids.copy_(rows_t[0], non_blocking=True)
        self.positions.copy_(rows_t[1], non_blocking=True)
        self.slots.copy_(rows_t[2], non_blocking=True)
        if visible:
            sizes = np.diff(np.asarray(layout.row_offsets, dtype=np.int64)) ** 2  # each sequence's [n, n]
            per_seq[2, 1:seqs] = np.cumsum(sizes[:-1])
            packed = layout.packed
            if packed is None:
                packed = torch.cat([v.reshape(-1) for v in layout.visible]).numpy()
            self.vis_offsets.copy_(torch.from_numpy(per_seq[2, :self.seqs]), non_blocking=True)
            self.visible[:packed.size].copy_(torch.from_numpy(packed.view(np.int8)), non_blocking=True)
        per_seq_t = torch.from_numpy(per_seq)
        self.starts.copy_(per_seq_t[0, :self.seqs], non_blocking=True)
        self.row_offsets.copy_(per_seq_t[1], non_blocking=True)
        self.tables.copy_(torch.from_numpy(tables), non_blocking=True)
        self.tiles.copy_(torch.from_numpy(tiles_for(layout.row_offsets, self.tiles.shape[0], self.block_m)),
                         non_blocking=True)

    def fill_recurrent(self, seqs: list[SeqRows], sources: torch.Tensor) -> None:
        """A hybrid verify's sequences: their state slots and their rows' conv windows (sources [R, W])."""
        slots = torch.zeros(self.seqs, dtype=torch.int32)
        slots[:len(seqs)] = torch.tensor([seq.slot for seq in seqs], dtype=torch.int32)
        self.state_slots.copy_(slots, non_blocking=True)
        self.sources[:sources.shape[0]].copy_(sources, non_blocking=True)

    def mask(self, page: int, window: int | None = None, visible: torch.Tensor | None = None) -> PagedMask:
        """The layout as the kernel reads it (`visible`: another visibility buffer at the same offsets)."""
        return PagedMask(self.rows, self.starts, self.row_offsets, self.tables,
                         self.visible if visible is None else visible, self.vis_offsets, self.tiles, page, window,
                         block_m=self.block_m)


class ContextRows:
    """The static inputs of a drafter context forward (fast/layers.Draft.context): the committed rows' tap features,
    gathered on the device from a forward's taps, and their positions and cache slots. Rows past the batch's
    repeat its first row into the pools' scratch slot."""

    def __init__(self, rows: int, width: int, scratch: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.scratch = rows, scratch
        self.feats = torch.zeros((rows, width), dtype=dtype, device=device)
        self.index = torch.zeros((3, rows), dtype=torch.long, device=device)  # taps rows, positions, slots
        self.positions, self.slots = self.index[1], self.index[2]

    def fill(self, taps: torch.Tensor, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """Rows `rows` of `taps` at `positions`, for `slots`: one copy to the device, one gather on it."""
        pad = self.rows - len(rows)
        host = torch.tensor([rows + [0] * pad, positions + [0] * pad, slots + [self.scratch] * pad], dtype=torch.long)
        self.index.copy_(host, non_blocking=True)
        torch.index_select(taps, 0, self.index[0], out=self.feats)


class Captured:
    """A batched forward over StaticRows, replayed as a CUDA graph (captured on first use), or run eagerly on
    the same buffers where graphs are off."""

    def __init__(self, run, rows: StaticRows | ContextRows, cuda: bool, pool: object | None) -> None:
        self.run, self.rows, self.cuda, self.pool = run, rows, cuda, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: object = None

    def __call__(self) -> object:
        if not self.cuda:
            return self.run(self.rows)
        if self.graph is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # first calls compile, probe and allocate
                for _ in range(2):
                    self.run(self.rows)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.out = self.run(self.rows)
        self.graph.replay()
        return self.out


def buckets(largest: int) -> list[int]:
    """Row counts a captured forward is padded to: multiples of 8 up to 64, then steps of a quarter of a power
    of two (a batch pads by at most a quarter)."""
    out, n = [8, 16, 24, 32, 40, 48, 56, 64], 64
    while out[-1] < largest:
        n *= 2
        out += [n * 5 // 8, n * 3 // 4, n * 7 // 8, n]
    return [b for b in out if b < largest] + [largest]
