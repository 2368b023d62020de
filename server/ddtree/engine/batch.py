"""The batch engine: many requests decoded together, one round at a time (continuous batching).

Each step the scheduler (schedule.py) picks the sequences that run and the prompt chunks that enter; every
backend then runs its share in one call (a batched backend: one drafter pass for every block, one target
forward over every tree, the draft nodes chosen across all requests under one budget, core/budget.py), and
each sequence's round goes through its own generation loop (generation.py: stops, the token limit, grammar,
logprobs), exactly as when it runs alone. A request that finishes, is cancelled or is preempted gives its
KV blocks back at once.

Backends that decode one request at a time (the reference path, the single-sequence fast path) take part
through `SerialBackend` (serial.py): each of their sequences runs its own rounds in turn within the step.

A request alone in the engine decodes on the single-request fast path (`solo`, engine/solo.py), whose whole
round runs on the device from CUDA graphs with the next round queued before this one is read: one user gets what
`ddtree bench --paths fast` measures. When another request comes in, the lone one moves to the batched path,
recomputed from its prompt and what it emitted, as a preempted request is (`_route`); with prefix caching its
prompt is in the cache by then, so only what it emitted is.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ddtree.core.blocks import BlockManager
from ddtree.core.budget import RoundChoice
from ddtree.core.rounds import BatchBackend, Prefill, Round
from ddtree.core.sampling import SamplingParams
from ddtree.engine.generation import RoundOutput
from ddtree.engine.schedule import Scheduler
from ddtree.engine.sequence import Sequence, Status
from ddtree.engine.serial import SerialBackend
from ddtree.errors import DDTreeError

if TYPE_CHECKING:
    from ddtree.engine.solo import SoloBackend

log = logging.getLogger("ddtree.engine")


@dataclass
class StepStats:
    """What one step ran, for metrics."""

    sequences: int = 0  # sequences that ran a decode round
    prefill_tokens: int = 0
    verified_tokens: int = 0  # target rows of the decode rounds (roots and draft nodes)
    draft_nodes: int = 0
    preempted: int = 0
    prefix_queries: int = 0  # context tokens of the admitted sequences looked up in the prefix cache
    prefix_hits: int = 0  # of which found there (not prefilled)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # the decode rounds' phases, summed


class BatchEngine:
    """Requests in, rounds out: `add` a request, call `step` until it finishes; `abort` frees it at once."""

    def __init__(self, engine, backends: Seq[BatchBackend], *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, blocks: BlockManager | None = None,
                 solo: SoloBackend | None = None) -> None:
        """`solo`: the single-request path a request alone decodes on instead of the first (batched) backend."""
        if not backends:
            raise ValueError("a batch engine needs at least one backend")
        self.engine, self.backends, self.blocks, self.solo = engine, list(backends), blocks, solo
        self.scheduler = Scheduler(blocks, max_num_seqs, max_num_batched_tokens)
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.last = StepStats()

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def add(self, prompt_ids: Seq[int], params: SamplingParams, *, method: str | None = None,
            budget: int | None = None, cache_salt: str | None = None) -> Sequence:
        """A new request: checked now (one-line errors), decoded from the next step on. Only requests with the
        same `cache_salt` share cached prompt prefixes."""
        request = self.engine.request(prompt_ids, params, method=method, budget=budget)
        generation = self.engine.generation(request, None)
        backend = next((b for b in self.backends if b.accepts(request)), None)
        if backend is None:
            raise DDTreeError("no decoding path takes this request")
        if backend.paged and self.blocks is not None:
            slots = len(request.prompt_ids) + params.max_new_tokens + backend.rows_per_round(request) + 1
            if self.blocks.blocks_for(slots) > self.blocks.num_blocks:
                raise DDTreeError(f"the request needs {slots} KV cache slots (prompt, max_tokens and one round), "
                                  f"more than the {self.blocks.num_blocks * self.blocks.block_size} the cache holds")
        seq = Sequence(next(self._ids), generation, backend, cache_salt=cache_salt)
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now (its client went away): its state and blocks are freed before the next step."""
        if seq.status is not Status.FINISHED:
            self._finish(seq)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """The share of KV blocks in use (0 without paged caches)."""
        return self.blocks.usage if self.blocks is not None else 0.0

    def step(self) -> list[tuple[Sequence, RoundOutput | Exception]]:
        """One step: every running sequence's next round (and the prompt chunks that fit), through each
        sequence's generation loop. Returns the outputs in the order the sequences run; a sequence whose round
        failed gets the exception and is finished (a batched backend's failure fails every sequence it ran)."""
        started = time.perf_counter()
        self._route()
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            seq.backend.close(seq.seq_id)
            seq.opened = False
        for seq, _, _ in plan.prefills:
            if not seq.opened:
                seq.backend.open(seq.seq_id, seq.request)
                seq.opened = True
        outputs: list[tuple[Sequence, RoundOutput | Exception]] = []
        stats = StepStats(preempted=len(plan.preempted), prefix_queries=plan.prefix_queries,
                          prefix_hits=plan.prefix_hits)
        counted: list[dict[str, float]] = []
        for backend in self.backends if self.solo is None else [self.solo, *self.backends]:
            prefills = [self._prefill(seq, lo, hi) for seq, lo, hi in plan.prefills if seq.backend is backend]
            decodes = [seq for seq in plan.decodes if seq.backend is backend]
            if not prefills and not decodes:
                continue
            try:
                rounds = backend.step(prefills, [seq.seq_id for seq in decodes], plan.node_limit)
            except Exception as exc:  # the backend's whole batch failed: those sequences end with the error
                rounds = {seq_id: exc for seq_id in [p.seq_id for p in prefills] + [s.seq_id for s in decodes]}
            for chunk in prefills:
                seq = self.sequences[chunk.seq_id]
                seq.cached = chunk.start + len(chunk.tokens)
                stats.prefill_tokens += len(chunk.tokens)
                if not isinstance(rounds.get(chunk.seq_id), Exception):
                    self.scheduler.written(seq)
            for seq in [self.sequences[p.seq_id] for p in prefills] + decodes:
                raw = rounds.get(seq.seq_id)
                if raw is None:
                    continue
                if isinstance(raw, Exception):
                    self._finish(seq)
                    outputs.append((seq, raw))
                    continue
                if not raw.is_prefill:
                    stats.sequences += 1
                    stats.verified_tokens += raw.nodes + 1
                    stats.draft_nodes += raw.nodes
                    if all(raw.phase_seconds is not seen for seen in counted):  # a batched round's are shared
                        counted.append(raw.phase_seconds)
                        for name, seconds in raw.phase_seconds.items():
                            stats.phase_seconds[name] = stats.phase_seconds.get(name, 0.0) + seconds
                outputs.append((seq, self._take(seq, raw)))
        stats.seconds = time.perf_counter() - started
        self.last = stats
        return outputs

    def _route(self) -> None:
        """A request alone takes the single-request path, if it has not started elsewhere and that path takes it;
        with company it moves to the batched path (`requeue`: recomputed there from its context). A sampled
        request with a seed stays batched, so its samples never depend on what else runs; so does one whose prompt
        starts with a cached prefix where the single-request path cannot read it (a hybrid's: engine/solo.py), to
        prefill only the rest on the batched path."""
        if self.solo is None:
            return
        live = [*self.scheduler.running, *self.scheduler.waiting]
        if len(live) == 1:
            seq = live[0]
            params = seq.request.params
            if (seq.backend is self.backends[0] and not seq.opened and not seq.generation.token_ids
                    and (params.greedy or params.seed is None) and self.solo.accepts(seq.request)
                    and (self.solo.paged or not self.scheduler.cached_prefix(seq))):
                seq.backend = self.solo
            return
        for seq in live:
            if seq.backend is self.solo:
                if seq.opened:
                    self.solo.close(seq.seq_id)
                    seq.opened = False
                if seq.status is Status.RUNNING:
                    self.scheduler.requeue(seq)
                seq.backend = self.backends[0]

    def _prefill(self, seq: Sequence, lo: int, hi: int) -> Prefill:
        context = seq.context
        last = hi >= seq.prefill_target
        resumed = bool(seq.generation.token_ids)
        return Prefill(seq.seq_id, context[lo:hi], lo, last, context[-1] if last and resumed else None)

    def _take(self, seq: Sequence, raw: Round) -> RoundOutput:
        out = seq.generation.take(raw)
        seq.cached = len(seq.request.prompt_ids) + len(seq.generation.token_ids) - 1
        if seq.generation.finish_reason is not None:
            self._finish(seq)
        return out

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if seq.opened:
            seq.backend.close(seq.seq_id)
            seq.opened = False
        seq.status = Status.FINISHED
        self.sequences.pop(seq.seq_id, None)
        if seq.generation.finish_reason is None:
            seq.generation.finish_reason = "abort"


@dataclass(frozen=True)
class BatchOptions:
    """How many requests decode together and in how much memory (vLLM's flags and meanings)."""

    max_num_seqs: int = 64  # requests decoded together
    max_num_batched_tokens: int = 2048  # rows one step may process: prompt chunks, roots and draft nodes
    gpu_memory_utilization: float = 0.9  # the share of the GPU the process may take; the KV pool gets the rest
    block_size: int = 16  # KV cache slots per block
    kv_cache_tokens: int | None = None  # the pool's size in slots; None: from the GPU's memory (CUDA), else a default
    batch_budget: bool = True  # choose the round's draft nodes across requests by the measured cost model
    single_request_path: bool = True  # a request alone decodes on the single-request fast path (CUDA graphs)
    prefix_caching: bool = True  # prompts reuse the cached K/V (and a hybrid's states) of the prefixes they share

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise DDTreeError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise DDTreeError("--max-num-batched-tokens must be at least --max-num-seqs (one row per request)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise DDTreeError("--gpu-memory-utilization must be in (0, 1]")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise DDTreeError("--block-size must be a power of two")


def alone_lengths(longest: int) -> list[int]:
    """Prompt lengths a lone request is warmed up at on a GPU: 2 tokens, then half again each step up to 1,600
    (or `longest`). A hybrid's prompt forward is eager (a dense target's replays graphs by bucket), and its
    attention launches one of several kernel builds by row count (kernels/attention.launch_config: rows are
    tokens x query heads per K/V head); steps of 1.5x land in each of them for any grouping, so no first request
    of a new length waits on a build. The second length also makes the compiled steps' shapes dynamic."""
    lengths, n = [], 2.0
    while round(n) <= min(longest, 1600):
        lengths.append(round(n))
        n *= 1.5
    return lengths or [max(1, longest)]


def warm_up(batch: BatchEngine, *settings: SamplingParams) -> list[str]:
    """Short requests per sampling setting through the batch engine, so the code paths its first requests take
    are compiled now (its CUDA graphs were captured when it was built): one alone (the single-request path's
    graphs) at each prompt length of `alone_lengths`, then a second joining it (the move to the batched path, and
    a batched round), then a prompt joining a batch whose cached prefix leaves it one row to prefill. Returns
    what was warmed up."""
    done = []
    engine = batch.engine
    prompt = [i % engine.vocab_size for i in range(1, 9)]
    longer = [i % engine.vocab_size for i in range(1, min(100, engine.max_context // 2))]
    on_gpu = engine.target.device.type == "cuda"
    lengths = alone_lengths(engine.max_context // 2) if on_gpu else [len(prompt), len(longer)]
    for params in settings:
        short = replace(params, max_new_tokens=2 * engine.block_size, ignore_eos=True)
        for length in lengths:  # each starts at its own token: no cached prefix shortens its prompt forward
            alone = [(length + i) % engine.vocab_size for i in range(length)]
            first = batch.add(alone, short)
            while first.status is not Status.FINISHED:
                batch.step()
        first = batch.add(prompt, short)
        batch.step()
        second = batch.add(prompt[::-1], short)
        while first.status is not Status.FINISHED or second.status is not Status.FINISHED:
            batch.step()
        # a prompt whose cached prefix leaves one row to prefill (rows a kernel specializes on), beside another
        pair = [batch.add(longer, short), batch.add(prompt, short)]
        batch.step()
        page = batch.blocks.block_size if batch.blocks is not None else 1
        pair.append(batch.add(longer[:len(longer) // page * page + 1], short))
        while any(seq.status is not Status.FINISHED for seq in pair):
            batch.step()
        done.append("greedy" if params.greedy else f"temperature {params.temperature:g}")
    return done


def batch_engine(engine, options: BatchOptions) -> BatchEngine:
    """The batch engine for a loaded engine: the batched fast path over paged caches where the target takes it
    (dense and MoE Qwen3 / Llama targets, hybrids), with the reference path for requests it declines; one
    request at a time on the single-sequence paths with --max-num-seqs 1, and on a GPU where the paged kernels do
    not build (PagedBackend.declines: the reference path would batch them many times slower)."""
    import torch

    from ddtree.engine.solo import SoloBackend
    from ddtree.fast.batch import PagedBackend
    from ddtree.fast.batch_memory import pool_tokens
    from ddtree.fast.support import unsupported

    reference = SerialBackend(engine.reference)
    one_at_a_time = None
    if engine.fast is not None and engine.target.device.type == "cuda" and options.max_num_seqs > 1:
        one_at_a_time = PagedBackend.declines(engine.target, engine.draft)
        if one_at_a_time is not None:
            log.warning("continuous batching is off: %s; decoding one request at a time on the fast path "
                        "(as --max-num-seqs 1)", one_at_a_time)
    if options.max_num_seqs == 1 or one_at_a_time is not None:
        singles = [SerialBackend(engine.fast, capacity=1)] if engine.fast is not None else []
        return BatchEngine(engine, [*singles, reference], max_num_seqs=1,
                           max_num_batched_tokens=options.max_num_batched_tokens)
    if unsupported(engine.target) is not None:
        return BatchEngine(engine, [reference], max_num_seqs=options.max_num_seqs,
                           max_num_batched_tokens=options.max_num_batched_tokens)
    tokens = options.kv_cache_tokens or pool_tokens(engine, options)
    blocks = BlockManager(max(1, tokens // options.block_size), options.block_size,
                          prefix_caching=options.prefix_caching)
    paged = PagedBackend(engine.target, engine.draft, engine.draft_head, blocks, max_seqs=options.max_num_seqs,
                         max_rows=options.max_num_batched_tokens)
    if engine.target.device.type == "cuda":
        with torch.inference_mode():
            paged.capture_all()
            if paged.device_round is not None and engine.method == "ddtree" and engine.budget >= 1:
                # every tree size its batches may choose, before the first request
                paged.device_round.capture_all(min(engine.budget, paged.max_tree),
                                               repeats=3 if options.batch_budget else 0)
            if options.batch_budget and engine.draft is not None:
                paged.cost = paged.measure_cost()
                paged.choice = RoundChoice()  # rounds draft only while drafting pays, as measured while serving
    solo = None
    if engine.fast is not None and options.single_request_path:  # its prompts share the pool's prefix cache
        solo = SoloBackend(engine.fast, paged if blocks.prefix is not None else None)
    return BatchEngine(engine, [paged, reference], max_num_seqs=options.max_num_seqs,
                       max_num_batched_tokens=options.max_num_batched_tokens, blocks=blocks, solo=solo)
