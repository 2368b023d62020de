"""A backend that decodes one request at a time (the reference path, the single-sequence fast path) as a batch
backend: its sequences take turns within a step (engine/batch.py)."""

from __future__ import annotations

from collections.abc import Iterator

from ddtree.core.rounds import Backend, DecodeRequest, Prefill, Round


class SerialBackend:
    """A one-request-at-a-time backend (`rounds` generators) as a batch backend: its sequences take turns, each
    running its next round within the step. Prompts go in whole; nothing is paged."""

    chunked = False
    paged = False
    prompt_only = False

    def __init__(self, backend: Backend, capacity: int | None = None) -> None:
        self.backend, self.capacity = backend, capacity
        self.name = backend.name
        self._rounds: dict[int, Iterator[Round]] = {}

    def accepts(self, request: DecodeRequest) -> bool:
        full = self.capacity is not None and len(self._rounds) >= self.capacity
        return not full and self.backend.accepts(request)

    def open(self, seq_id: int, request: DecodeRequest) -> None:
        self._rounds[seq_id] = self.backend.rounds(request)

    def close(self, seq_id: int) -> None:
        rounds = self._rounds.pop(seq_id, None)
        if rounds is not None:
            rounds.close()

    def rows_per_round(self, request: DecodeRequest) -> int:
        return 0

    def step(self, prefills: list[Prefill], decodes: list[int],
             node_limit: int | None) -> dict[int, Round | Exception]:
        """Each sequence's next round; one that fails gets its exception, the others go on."""
        out: dict[int, Round | Exception] = {}
        for seq_id in [p.seq_id for p in prefills] + decodes:
            try:
                out[seq_id] = next(self._rounds[seq_id])
            except Exception as exc:  # one request's failure must not stop the others
                out[seq_id] = exc
        return out
