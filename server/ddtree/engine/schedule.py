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

With prefix caching (core/prefix_cache.py) a sequence is matched against the cache when it is admitted: the
cached blocks its prompt starts with join its table and its prefill starts after them. The last prompt token is
always computed (its logits pick the first token), so a hit stops at least one token short of the prompt; a
request that asks for prompt logprobs computes its whole prompt. Once a prompt chunk is written, the prompt's
full blocks it completed are registered for later requests. A backend whose rounds run in caches of their own
(`prompt_only`: the single-request path, engine/solo.py) holds blocks for its prompt alone.
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
    prefix_queries: int = 0  # context tokens of the sequences admitted, looked up in the prefix cache
    prefix_hits: int = 0  # of which found there

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
            if seq.backend.prompt_only:  # its rounds write caches of its own
                plan.decodes.append(seq)
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
            looked_up = self._match(seq)
            if not self._fits(seq, budget, prefilling=bool(plan.prefills)):
                self._free(seq)
                seq.cached = seq.cached_prompt = 0
                break
            if looked_up:
                plan.prefix_queries += seq.prefill_target
                plan.prefix_hits += seq.cached
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget = self._chunk(seq, budget, plan)
        plan.node_limit = max(budget, 0)
        return plan

    def cached_prefix(self, seq: Sequence) -> int:
        """Context tokens the sequence would find in the prefix cache now (nothing is taken)."""
        if not self._caches(seq):
            return 0
        return self.block_size * len(self.blocks.prefix.lookup(self._lookup_hashes(seq)))

    @property
    def block_size(self) -> int:
        return self.blocks.block_size if self.blocks is not None else 1

    def _caches(self, seq: Sequence) -> bool:
        """Whether the sequence looks its prefix up: prefix caching on, a paged backend, no prompt logprobs."""
        return (self.blocks is not None and self.blocks.prefix is not None and seq.backend.paged
                and seq.request.params.prompt_logprobs is None)

    def _lookup_hashes(self, seq: Sequence) -> list[bytes]:
        """The prompt's block hashes a hit may cover: never the block of the last context token to prefill."""
        return seq.prompt_hashes(self.block_size)[:(seq.prefill_target - 1) // self.block_size]

    def _match(self, seq: Sequence) -> bool:
        """At admission: the cached blocks the sequence's prompt starts with become its first blocks, and its
        prefill starts after them. Returns whether it looked."""
        if seq.cached or not self._caches(seq):
            return False
        seq.cached = self.block_size * self.blocks.match(seq.seq_id, self._lookup_hashes(seq))
        seq.cached_prompt = seq.cached
        return True

    def written(self, seq: Sequence) -> None:
        """The sequence's caches hold its first `seq.cached` context tokens: the prompt's full blocks among them
        join the prefix cache."""
        if self.blocks is None or self.blocks.prefix is None or not seq.backend.paged:
            return
        done = min(seq.cached, len(seq.request.prompt_ids)) // self.block_size
        self.blocks.register(seq.seq_id, seq.prompt_hashes(self.block_size)[:done])

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
        remaining = seq.prefill_target - seq.cached
        if seq.backend.chunked:
            if budget <= 0:
                return False
            first = min(budget, remaining)
        else:
            if remaining > budget and prefilling:
                return False
            first = remaining
        if self.blocks is None or not seq.backend.paged:
            return True
        return self.blocks.missing(seq.seq_id, seq.cached + first) <= self.blocks.free_blocks
