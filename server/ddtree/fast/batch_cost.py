"""The batch budget's cost model, measured on the device before any sequence runs: what a verify forward takes
at each bucket of rows, and what each drafting request adds to the drafter's block pass."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ddtree.core.blocks import BlockManager
from ddtree.core.budget import CostModel
from ddtree.fast.plan import now
from ddtree.kernels import gdn
from ddtree.kernels.paged_attention import PagedLayout


class Measured(Protocol):
    """What the measurement needs of the paged backend (fast/batch.PagedBackend), named here so that this module
    sits below the backend that calls it."""

    page: int
    buckets: list[int]
    max_rows: int
    max_seqs: int
    block: int
    blocks: BlockManager
    hybrid: Any
    draft: Any
    cuda: bool

    def _seq_rows(self, seq_ids: list[int], layout: PagedLayout) -> Any: ...
    def _run(self, kind: str, *args: Any) -> Any: ...
    def _now(self) -> float: ...


def measure_cost(backend: Measured, repeats: int = 3) -> CostModel:
    """The round's cost model on this device, measured before any sequence runs: the verify forward at each
    bucket of rows (one sequence of that many causal rows), and the drafter's block pass per sequence (the
    slope between one block and eight). The pools are empty, so the rows may write any slots."""
    page = backend.page
    samples = [b for b in backend.buckets if b <= max(8, backend.max_rows)]

    def layout(rows: int, seqs: int) -> tuple[list[int], list[int], list[int], PagedLayout]:
        per = rows // seqs
        lay = PagedLayout([], [0], [], [])
        for s in range(seqs):
            lay.starts.append(0)
            lay.row_offsets.append(lay.row_offsets[-1] + per)
            lay.tables.append([(s * per // page + i) % backend.blocks.num_blocks for i in range(-(-per // page))])
            lay.visible.append(torch.ones(per, per, dtype=torch.bool).tril())
        slots = [lay.tables[r // per][(r % per) // page] * page + r % page for r in range(per * seqs)]
        return [0] * (per * seqs), [r % per for r in range(per * seqs)], slots, lay

    def timed(kind: str, rows: int, seqs: int) -> float:
        ids, positions, slots, lay = layout(rows, seqs)
        seq_rows = backend._seq_rows([], lay)  # a hybrid's: the verify reads the (empty) state slots in order
        record = backend.hybrid.record(seq_rows) if backend.hybrid and kind == "verify" else None
        args = (ids, positions, slots, lay, seq_rows, record)
        for _ in range(2):  # capture (on a GPU) and warm up
            backend._run(kind, *args)
        times = []
        for _ in range(repeats):
            t = now(backend.cuda)
            backend._run(kind, *args)
            times.append(now(backend.cuda) - t)
        return min(times)

    points, slowest = [], 0.0
    if backend.hybrid:  # a hybrid's verify holds at most TREE_MAX rows a sequence
        samples = [b for b in samples if b <= backend.max_seqs * gdn.TREE_MAX]
    for rows in samples:  # more rows never take less time: noise is flattened out
        seqs = max(1, min(backend.max_seqs, rows // 16), -(-rows // (gdn.TREE_MAX if backend.hybrid else rows)))
        slowest = max(slowest, timed("verify", rows, seqs))
        points.append((rows, slowest))
    per_request = 0.0
    if backend.draft is not None and backend.max_seqs >= 8 and 8 * backend.block <= backend.buckets[-1]:
        one, eight = timed("draft", backend.block, 1), timed("draft", 8 * backend.block, 8)
        per_request = max((eight - one) / 7, 0.0)
    return CostModel(tuple(points), per_request)

