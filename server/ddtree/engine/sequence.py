"""One request inside the batch engine: its generation loop, the backend it decodes on, and its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ddtree.core.prefix_cache import block_hashes
from ddtree.core.rounds import BatchBackend, DecodeRequest
from ddtree.engine.generation import Generation


class Status(enum.Enum):
    WAITING = "waiting"  # not started yet, or preempted (its caches dropped, to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    generation: Generation
    backend: BatchBackend
    status: Status = Status.WAITING
    cached: int = 0  # context tokens written to the caches so far
    preemptions: int = 0
    opened: bool = field(default=False, repr=False)
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes
    cached_prompt: int = 0  # prompt tokens its last admission found in the prefix cache
    _hashes: list[bytes] | None = field(default=None, repr=False)

    def prompt_hashes(self, block_size: int) -> list[bytes]:
        """The hash chain of the prompt's full blocks (core/prefix_cache.py), computed once."""
        if self._hashes is None:
            self._hashes = block_hashes(self.request.prompt_ids, block_size, self.cache_salt)
        return self._hashes

    @property
    def request(self) -> DecodeRequest:
        return self.generation.request

    @property
    def context(self) -> list[int]:
        """Every token so far: the prompt, then what the sequence emitted."""
        return [*self.request.prompt_ids, *self.generation.token_ids]

    @property
    def prefill_target(self) -> int:
        """Context tokens the caches must hold before the first decode round: the prompt, or for a sequence
        resumed after preemption, everything but the last emitted token (the next round's root)."""
        emitted = len(self.generation.token_ids)
        return len(self.request.prompt_ids) + max(emitted - 1, 0)

    @property
    def decoding(self) -> bool:
        """Past its prefill: each step runs one round."""
        return self.status is Status.RUNNING and self.cached >= self.prefill_target and bool(
            self.generation.token_ids)
