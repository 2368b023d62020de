"""The seam between the decoding loop and the backends that run rounds.

`engine.generation.Generation` owns everything a request sees (emission, stop ids, the token limit, grammar
state, logprobs, statistics) and drives a backend: the reference path (`engine.reference`, the oracle) or the
GPU fast path (`fast.runner`). A backend only runs rounds: it takes a `DecodeRequest` and yields one `Round`
per target forward, the prefill first. Neither side reaches into the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ddtree.core.grammar import Constraint
from ddtree.core.sampling import SamplingParams

PHASES = ("draft", "tree", "verify", "commit")


@dataclass
class DecodeRequest:
    """One request as a backend decodes it. `constraint` is the request's grammar state: the loop feeds it the
    emitted tokens after each round, the backend reads it to mask the next round's nodes."""

    prompt_ids: list[int]
    params: SamplingParams
    method: str  # "ar", "dflash" or "ddtree"
    budget: int  # draft nodes a ddtree round may verify (0 for the other methods)
    constraint: Constraint | None = None


@dataclass
class Round:
    """What one target forward (or the prefill) committed, before the loop cuts it at a stop id or the limit."""

    tokens: list[int]  # the target's picks along the accepted path: accepted draft tokens, then the bonus
    nodes: int  # tree nodes verified, root excluded (0 for the prefill)
    accepted: int  # accepted draft tokens (the bonus excluded)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    logprob_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # `token_logprobs` of `tokens`, in order
    prompt_logits: torch.Tensor | None = None  # the prefill's raw logits of every prompt row, when asked for
    is_prefill: bool = False


class Backend(Protocol):
    """Runs a request's rounds. Closing the iterator frees whatever the request holds."""

    name: str  # "reference" or "fast", for logs and tests

    def accepts(self, request: DecodeRequest) -> bool:
        """Whether this backend can decode the request (the reference path takes every request)."""

    def rounds(self, request: DecodeRequest) -> Iterator[Round]:
        """The prefill's Round, then one per target forward, for as long as the caller asks."""


@dataclass
class Prefill:
    """A slice of a sequence's context to write into its caches this step (chunked prefill): context tokens
    [start, start + len(tokens)). At the last chunk of a new sequence the backend picks its first token (a
    prefill Round); a sequence resumed after preemption already emitted it (`root`), so none is picked."""

    seq_id: int
    tokens: list[int]
    start: int
    last: bool
    root: int | None = None  # a resumed sequence's next token, already emitted


class BatchBackend(Protocol):
    """Runs the rounds of many sequences at once (engine/batch.py schedules them)."""

    name: str
    chunked: bool  # takes a prompt in chunks over several steps (else whole, in one step)
    paged: bool  # its caches live in the batch engine's blocks (engine/blocks.py)
    prompt_only: bool  # (paged) only its prompts live in the blocks: its rounds write caches of its own

    def accepts(self, request: DecodeRequest) -> bool:
        """Whether this backend can decode the request."""

    def open(self, seq_id: int, request: DecodeRequest) -> None:
        """A sequence starts (or starts again, after preemption) on this backend."""

    def close(self, seq_id: int) -> None:
        """The sequence ends, is cancelled or preempted: drop what it holds."""

    def rows_per_round(self, request: DecodeRequest) -> int:
        """Cache slots past the committed ones that one decode round of the request may write."""

    def step(self, prefills: list[Prefill], decodes: list[int], node_limit: int | None) -> dict[int, Round]:
        """Write the prefill chunks, run one round of each decoding sequence (their draft nodes chosen together,
        at most `node_limit` in all when given), commit; the Rounds by sequence id (a prefill chunk that is not
        the last of a new sequence has none)."""
