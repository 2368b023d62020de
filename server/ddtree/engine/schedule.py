"""Which sequences run in the next step, and how much of each: continuous batching under three limits.

- `max_num_seqs`: sequences decoded together (running, prefilling included).
- `max_num_batched_tokens`: rows one step may process. Running sequences come first, one root row each; prompt
  chunks of sequences being admitted take what is left (chunked prefill: a long prompt enters over several
  steps, so running streams keep flowing, with a bounded inter-token latency); the draft nodes of the round's
  trees take the rest (the batch budget, engine/batch.py).
- KV blocks (core/blocks.py): a sequence is admitted when its next chunk's slots fit the free blocks, and a
  decoding sequence first takes the blocks its next round writes. When they run out, the most recently admitted
  running sequence is preempted: its blocks and caches go, and it waits at the head of the queue to be
  recomputed from its prompt and what it already emitted (vLLM's recompute preemption), which gives the same
  output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ddtree.core.blocks import BlockManager, OutOfBlocks
from ddtree.engine.sequence import Sequence, Status


@dataclass
class StepPlan:
    prefills: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, context lo, hi)
    decodes: list[Sequence] = field(default_factory=list)
    node_limit: int | None = None  # draft nodes the round may verify in all
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, blocks: BlockManager | None, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """The sequence ended or was cancelled: it leaves whichever queue holds it, with its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        if self.blocks is not None and seq.backend.paged:
            self.blocks.free(seq.seq_id)

    def _reserve(self, seq: Sequence, slots: int) -> bool:
        """The sequence's blocks grown to `slots` cache slots; False (nothing allocated) when they do not fit."""
        if self.blocks is None or not seq.backend.paged:
            return True
        try:
            self.blocks.ensure(seq.seq_id, slots)
            return True
        except OutOfBlocks:
            return False

    def requeue(self, seq: Sequence) -> None:
        """The running sequence goes back to the head of the queue, its blocks and caches dropped: it is
        recomputed from its prompt and what it already emitted, on whichever backend it then has."""
        self.running.remove(seq)
        self._free(seq)
        seq.status, seq.cached = Status.WAITING, 0
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.requeue(seq)
        seq.preemptions += 1
        plan.preempted.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # 1. Every decoding sequence runs a round, once it holds the blocks that round writes; when blocks run
        #    out, the newest running sequence gives its up (possibly the one asking).
        for seq in list(self.running):
            if seq not in self.running or not seq.decoding:
                continue
            need = seq.cached + 1 + seq.backend.rows_per_round(seq.request)
            while not self._reserve(seq, need):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq in self.running:
                plan.decodes.append(seq)
        budget = self.max_num_batched_tokens - len(plan.decodes)
        # 2. Prompt chunks: sequences already prefilling, then waiting ones (preempted first), while there is
        #    room in the batch, in the token budget and in the blocks.
        for seq in [s for s in self.running if not s.decoding and s not in plan.decodes]:
            budget = self._chunk(seq, budget, plan)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._fits(seq, budget, prefilling=bool(plan.prefills)):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget = self._chunk(seq, budget, plan)
        plan.node_limit = max(budget, 0)
        return plan

    def _chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Plan the sequence's next prompt chunk (as much as the token budget and the blocks allow; all of it on
        a backend that cannot chunk); returns the budget left."""
        remaining = seq.prefill_target - seq.cached
        chunk = min(remaining, budget) if seq.backend.chunked else remaining
        if chunk <= 0 or not self._reserve(seq, seq.cached + chunk):
            return budget
        plan.prefills.append((seq, seq.cached, seq.cached + chunk))
        return budget - chunk

    def _fits(self, seq: Sequence, budget: int, prefilling: bool) -> bool:
        """Whether a waiting sequence can start now: a token budget for at least part of its prompt (all of
        it on a backend that cannot chunk, unless nothing else prefills), and the blocks for that part."""
        if seq.backend.chunked:
            if budget <= 0:
                return False
            first = min(budget, seq.prefill_target)
        else:
            if seq.prefill_target > budget and prefilling:
                return False
            first = seq.prefill_target
        if self.blocks is None or not seq.backend.paged:
            return True
        return self.blocks.missing(seq.seq_id, first) <= self.blocks.free_blocks
