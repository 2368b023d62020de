"""A prompt's prefill replayed as CUDA graphs, one per bucket of row counts.

An eager prefill launches a few hundred kernels whatever the prompt's length, and each library GEMM of a new row
count costs the host tens of microseconds to plan: on an H100 the demo pair's 130-token prefill took 7 ms of host
time for 0.33 ms of GPU work, and a row count the attention kernel had not seen built a new kernel variant on the
request's time (0.8-1.5 s). Here the rows are padded to the next bucket (`PROMPT_BUCKETS`, at most 1.5x the rows
from 16 up) and a prompt longer than the largest bucket runs in chunks of it, each seeing the chunks before it
through the cache like a cached prefix. Every bucket is captured once, before the first request's prefill, so no
request builds a kernel.

Padding rows hold stale token ids. They sit after the real rows, and the prompt's mask is causal, so no real row
sees them; their K/V and drafter context land in cache rows past the prompt, which every mask hides until a round
overwrites them (as the rows a round rejects). The logits are the last real row's, picked by a device index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

PROMPT_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket_for(rows: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
    """The smallest bucket that holds `rows` (1 <= rows <= the largest bucket)."""
    return next(b for b in buckets if b >= rows)


def chunk_lengths(rows: int, largest: int) -> list[int]:
    """A prompt of `rows` rows in chunks of the largest bucket, the rest last."""
    full, rest = divmod(rows, largest)
    return [largest] * full + ([rest] if rest else [])


class PromptPath(Protocol):
    """What a prompt's graphs drive (fast/runner.py's FastPath): static caches of `capacity` rows, the cached
    length `start` [1] and row offsets `steps`, and one chunk's forward."""

    capacity: int
    device: torch.device
    start: torch.Tensor
    steps: torch.Tensor

    def prompt_chunk(self, ids: torch.Tensor, positions: torch.Tensor, causal: torch.Tensor,
                     last: torch.Tensor) -> torch.Tensor:
        """The target's forward of a chunk (logits of row `last`), then the drafter's context of every row."""


class PromptGraphs:
    """The prompt's forward (logits of its last row, drafter context of every row) for each bucket, replayed
    with the prompt's ids copied into a static buffer; `capture` None (the CPU) runs the same padded steps
    eagerly."""

    def __init__(self, path: PromptPath, buckets: tuple[int, ...] = PROMPT_BUCKETS,
                 capture: Callable[[Callable[[int], torch.Tensor], int], tuple[object, torch.Tensor]] | None = None,
                 ) -> None:
        self.path, self._capture = path, capture
        self.buckets = tuple(b for b in buckets if b <= path.capacity) or (path.capacity,)
        device = path.device
        self.ids = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # the last real row of the chunk
        self.causal = {b: torch.ones(b, b, dtype=torch.bool, device=device).tril() for b in self.buckets}
        self._graphs: dict[int, tuple[object, torch.Tensor]] = {}

    def fits(self, start: int, rows: int) -> bool:
        """Whether `rows` new rows after `start` cached ones, padded, stay inside the static caches."""
        *full, last = chunk_lengths(rows, self.buckets[-1])
        return start + sum(full) + bucket_for(last, self.buckets) <= self.path.capacity

    def capture(self) -> None:
        """Capture every bucket's graph (start-up: it writes cache rows, so never while a request decodes)."""
        if self._capture is None or self._graphs:
            return
        for b in self.buckets:
            self._graphs[b] = self._capture(self._step, b)

    def run(self, prompt: torch.Tensor, start: int) -> torch.Tensor:
        """Prefill `prompt` [n] after `start` cached rows (which `path.start` holds on return: start + n);
        returns the last row's logits [1, V] (a static buffer: read it before the next prefill)."""
        self.capture()
        path, lo, logits = self.path, 0, None
        for length in chunk_lengths(prompt.numel(), self.buckets[-1]):
            bucket = bucket_for(length, self.buckets)
            self.ids[:length].copy_(prompt[lo:lo + length], non_blocking=True)
            self.last.fill_(length - 1)
            path.start.fill_(start + lo)
            if bucket in self._graphs:
                graph, logits = self._graphs[bucket]
                graph.replay()
            else:
                logits = self._step(bucket)
            lo += length
        path.start.fill_(start + lo)
        return logits

    def _step(self, bucket: int) -> torch.Tensor:
        """One padded chunk of `bucket` rows at path.start: the target's forward, then the drafter's context."""
        path = self.path
        return path.prompt_chunk(self.ids[:bucket], path.start + path.steps[:bucket], self.causal[bucket], self.last)
