"""The single-request path inside the batch engine: a request alone decodes there (engine/batch.py routes it), its
whole round on the device from CUDA graphs.

With prefix caching its prompt shares the batched path's paged pool. The scheduler matches the prompt against the
prefix cache as it does a batched sequence's and gives it blocks for the rest of the prompt; the prefill reads the
cached rows into the single path's static caches, computes only the rest and writes those rows into the blocks,
which then join the prefix cache (fast/runner.py `PooledPrompt`). So a lone request skips a cached prefix, leaves
its prompt for the requests after it, and when company arrives and it moves to the batched path it finds its
prompt there and recomputes only what it emitted. Its rounds run in the single path's own caches: no block is held
for them. A hybrid target's lone requests keep to their own caches (their states would need checkpoints).
"""

from __future__ import annotations

from ddtree.core.rounds import DecodeRequest, Prefill, Round
from ddtree.engine.serial import SerialBackend
from ddtree.fast.batch import PagedBackend
from ddtree.fast.runner import FastPath


class SoloBackend(SerialBackend):
    """The single-request fast path, one request at a time; `pool`: the batched backend whose paged pool and blocks
    its prompts share (None: prefix caching off, or a target whose single path cannot pool its prompts)."""

    prompt_only = True  # with a pool, only the prompt lives in the blocks: the rounds write the path's own caches

    def __init__(self, fast: FastPath, pool: PagedBackend | None = None) -> None:
        super().__init__(fast, capacity=1)
        self.pool = pool if pool is not None and fast.pools_prompts else None
        self.paged = self.pool is not None
        self._opening: dict[int, DecodeRequest] = {}  # opened, its rounds made at its prefill (which knows its blocks)

    def open(self, seq_id: int, request: DecodeRequest) -> None:
        if self.paged:
            self._opening[seq_id] = request
        else:
            super().open(seq_id, request)

    def close(self, seq_id: int) -> None:
        self._opening.pop(seq_id, None)
        super().close(seq_id)

    def step(self, prefills: list[Prefill], decodes: list[int],
             node_limit: int | None) -> dict[int, Round | Exception]:
        for chunk in prefills:  # a lone request's prompt comes whole, after its cached prefix (chunk.start tokens)
            request = self._opening.pop(chunk.seq_id, None)
            if request is not None:
                pooled = self.pool.pooled_prompt(chunk.seq_id, chunk.start, chunk.start + len(chunk.tokens))
                self._rounds[chunk.seq_id] = self.backend.rounds(request, pooled=pooled)
        return super().step(prefills, decodes, node_limit)
