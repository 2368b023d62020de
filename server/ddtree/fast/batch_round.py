"""A batch's whole DDTree round on the device, greedy or sampled: draft, trees, verify, acceptance walk and
commit in one CUDA graph per bucket of requests, with one small copy in and one out.

The host path (fast/batch.py `_round`) waits for the device twice a round and builds, walks and commits every
tree in Python: at 8 requests its round took 5 ms of host time for well under 1 ms of GPU work, and served
ddtree fell below plain decoding as soon as two users shared the server. Here the host writes each request's
(start, root, node allowance, draft depth, sampling settings) and block table into one buffer, replays the bucket's
graph, and reads back each request's accepted length, verified nodes and emitted tokens:

    draft    [root, mask x D] for every request at its start, over its own context (the captured block pass)
    trees    the vocabulary top-k of every draft row, then every request's best-first tree (kernels/tree.py
             `batch_prefixes`; a `dflash` request's chain of top tokens instead), cut to its first `nodes` nodes
             and its allowance (0: an `ar` request)
    verify   the roots and trees as rows start, start + 1, ... in the paged pool, each seeing its own ancestors
             (the transitive closure of its parent edges)
    walk     the target's pick at every row (its argmax, or for a sampling request an independent sample of
             softmax(logits / T) over what its filters keep, kernels/tree.py `vocab_sample` above
             core/sampling.py `filter_floor`); a node is accepted when every node on its root
             path matches its parent's pick; the path is one node per depth, and its last node's pick is the
             bonus token. A sampled path is the target's own sampling: each pick is a fresh draw given the path
             above it, whatever tree the drafter offered
    commit   the path's K/V rows move down to start.. and their taps extend the drafter's context

A round with nothing to draft (every request `ar`, or the batch budget's choice not to draft this step) is plain:
no draft pass and no tree, each request's root verified alone (one row a request: the paged attention's one-row
tiles), picked and committed in the same graph, queued a step ahead like any other. Every request in a device
round picks on the device (`picks_on_device`: greedy, or an unseeded sample with min-p, a top-k up to FILTER_CAP
and top-p within it; no processor, penalty, bias, grammar or logprobs) on a dense target with a DFlash drafter;
the others, and rounds the batch budget would cut below a tree a request, take the host path. A round's picks
take one of three graphs: greedy (the argmax alone; captured at start-up), sampled, or sampled with filters (each
captured the first time such a round runs); a round with `dflash` requests, graphs that also lay out their chains
(captured on first use too). The trees are not cut across requests here: each request verifies its own first
`nodes` nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import torch

from ddtree.core.rounds import PHASES, Round
from ddtree.core.sampling import SamplingParams, filter_floor
from ddtree.fast.batch_rows import Captured, StaticRows
from ddtree.fast.batch_seq import SeqState, plain_greedy, plain_sampled
from ddtree.fast.runner import MAX_BUDGET
from ddtree.kernels.paged_attention import tile_rows, tiles_for
from ddtree.kernels.tree import ancestors, batch_prefixes, tree_size, vocab_argmax, vocab_sample, vocab_top
from ddtree.switches import SWITCHES


class RoundBackend(Protocol):
    """What a device round needs of the paged backend (fast/batch.PagedBackend), named here so that this module
    sits below the backend that calls it: its pools, drafter and target row forwards, and round bookkeeping."""

    block: int
    page: int
    max_context: int
    max_rows: int
    max_seqs: int
    max_tree: int
    device: torch.device
    cuda: bool
    pool: Any
    scratch: int
    blocks: Any
    kv: torch.Tensor
    draft_kv: torch.Tensor
    draft: Any
    draft_head: Any
    draft_rope: Any
    fused_draft: Any
    ops: Any
    cost: Any
    calibration: Any
    choice: Any
    last_nodes: int
    last_predicted: float | None
    _previous: Any

    def _depth(self, state: SeqState) -> int: ...
    def _draft_rows(self, *args: Any) -> Any: ...
    def _target_rows(self, *args: Any) -> Any: ...

REQUEST_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# per request: start, root, node allowance, draft depth (-1: a padding request), temperature (a float64's bits;
# 0: greedy), the round's Philox seed (the first request's is read), top-k, top-p and min-p (float64 bits), and
# whether it verifies a chain (`dflash`) rather than a tree
INPUTS = 10
PLAIN = (0, 0)  # the size of a round that drafts nothing: every request's root alone, no draft pass, no tree
FILTER_CAP = 64  # the most logits a filtered sample ranks a row: its top-k's bound (top-p needs a top-k)
Picks = Literal["greedy", "sampled", "filtered"]  # a round's picks: all greedy, some sampling, some with filters


def _settings(params: SamplingParams) -> tuple[float, float, float, float]:
    """(temperature, top-k, top-p, min-p) as the round reads them; a greedy request's filters off."""
    if params.greedy:
        return 0.0, 0.0, 1.0, 0.0
    return params.temperature, float(max(params.top_k, 0)), params.top_p, params.min_p


def picks_on_device(state: SeqState) -> bool:
    """Whether the round's picking kernel makes this request's picks: greedy, or an unseeded sample whose filters
    filter_floor takes (min-p, a top-k up to FILTER_CAP, top-p only with such a top-k)."""
    params = state.request.params
    if plain_greedy(state):
        return True
    return plain_sampled(state) and params.top_k <= FILTER_CAP and (params.top_p >= 1.0 or params.top_k > 0)


def request_bucket(requests: int, largest: int) -> int:
    """The smallest bucket of requests that holds `requests` (the largest is the backend's max_seqs)."""
    return next((b for b in REQUEST_BUCKETS if b >= requests and b <= largest), largest)


@dataclass
class Queued:
    """A round replayed on the device and not read yet: its requests as they were launched, and its graph."""

    seq_ids: list[int]
    states: list[SeqState]
    methods: list[str]
    captured: _Captured
    nodes: int
    budget: int


class Taken(NamedTuple):
    """A queued round's result, read, and which of its requests (rows) it moved on."""

    queued: Queued
    result: RoundResult
    mine: list[int]


@dataclass
class RoundResult:
    """What a device round hands back per request (host arrays): the accepted length (path nodes, the root
    included), the draft nodes verified, the emitted tokens and the accepted path's nodes (the first `length`
    of each row), and the tree's nodes' prefix log-probabilities under the drafter, best first (-inf: none)."""

    lengths: np.ndarray  # [S] int64
    nodes: np.ndarray  # [S] int64
    emitted: np.ndarray  # [S, D + 1] int64
    path: np.ndarray  # [S, D + 1] int64
    scores: np.ndarray  # [S, N] float64: every node of the trees built (at the budget), verified or not


class DeviceRound:
    """One captured round per (bucket of requests, nodes a tree verifies, the trees' budget): `step` chooses the
    size and turns the result into each request's round, `replay` fills the inputs and replays, `read` waits for
    and reads the result."""

    def __init__(self, backend: RoundBackend) -> None:
        self.backend = backend
        self.depth = backend.block - 1
        # block-table entries a round may read: a request's rows run past its context's end by up to a tree
        self.width = -(-(backend.max_context + max(MAX_BUDGET, backend.block) + 1) // backend.page) + 1
        self._rounds: dict[tuple[int, int, int, Picks], _Captured] = {}
        self._seeds = np.random.default_rng()
        # (bucket, tree nodes, budget) -> a round's own time, measured at start-up (`capture_all`): draft, trees,
        # verify, walk and commit, which the verify-only cost model would leave out
        self.seconds: dict[tuple[int, int, int], float] = {}
        self.budgets: set[int] = set()  # tree budgets captured at start-up (`capture_all`)
        self.queued: Queued | None = None  # the next step's round, replayed before this step's results are taken

    def step(self, seq_ids: list[int], states: list[SeqState], node_limit: int | None, started: float,
             drafts: bool = True) -> dict[int, Round]:
        """These decoding requests' rounds on the device: the results of the round queued last step for those in
        it, else (none queued) a round now where the device takes them all (`size`); `drafts`: whether this step
        drafts at all (RoundChoice). Then, with overlap on, the next round is queued for every request that goes
        on, so the device runs it while the host turns these results into text and schedules the next step.
        Requests that get no result here and are not queued take the host path this step.

        The device waits on the host only from the result's arrival to the next replay: the size is chosen while
        the queued round still runs (from the trees of the round before it), and the next round is replayed as soon
        as the states have moved on, before the results become rounds."""
        queued, self.queued = self.queued, None
        current = dict(zip(seq_ids, states, strict=True))
        size = self.size(states, node_limit, drafts)
        taken = self.take(queued, current) if queued is not None else None
        if taken is None and size is not None:  # nothing queued for these requests: their round now
            taken = self.take(self.launch(seq_ids, states, size), current)
        if size is not None and SWITCHES.overlap:
            going = [i for i, state in enumerate(states) if not self._done(state)]
            if going:  # a smaller batch fits the size chosen for all of them
                self.queued = self.launch([seq_ids[i] for i in going], [states[i] for i in going], size)
        return self.rounds(taken, started) if taken is not None else {}

    def queues(self, seq_id: int) -> bool:
        """Whether the round queued for the next step holds this request."""
        return self.queued is not None and seq_id in self.queued.seq_ids

    def _done(self, state: SeqState) -> bool:
        """Whether the request has all its tokens once its last result is taken (its token limit, or the context
        full), so no round is queued for it; one that ends on a stop token still runs one queued round, dropped."""
        request = state.request
        return (state.start + 1 >= self.backend.max_context
                or state.start + 1 - len(request.prompt_ids) >= request.params.max_new_tokens)

    def launch(self, seq_ids: list[int], states: list[SeqState], size: tuple[int, int]) -> Queued:
        """These requests' round at `size` (nodes a tree verifies, the trees' budget: `size`) replayed on the device
        from their states, not read yet."""
        nodes, budget = size
        count = len(states)
        methods = [state.request.method for state in states]
        allowed = [min(state.request.budget, nodes) if method == "ddtree" else nodes if method == "dflash" else 0
                   for state, method in zip(states, methods, strict=True)]
        captured = self.replay(np.fromiter((state.start for state in states), np.int64, count),
                               np.fromiter((state.root for state in states), np.int64, count), np.array(allowed),
                               np.fromiter((self.backend._depth(state) for state in states), np.int64, count),
                               np.array([_settings(state.request.params) for state in states], dtype=np.float64),
                               [self.backend.blocks.tables[seq_id] for seq_id in seq_ids], nodes, budget,
                               np.array([method == "dflash" for method in methods]))
        return Queued(list(seq_ids), list(states), methods, captured, nodes, budget)

    def take(self, queued: Queued, current: dict[int, SeqState]) -> Taken | None:
        """A replayed round's result (the host waits for it here), for the requests still decoding with the state it
        was launched from (one finished, aborted or preempted since has none: None when no request has); each one's
        state moves on: start, root, and its tree's scores for the next round's size."""
        mine = [r for r, (seq_id, state) in enumerate(zip(queued.seq_ids, queued.states, strict=True))
                if current.get(seq_id) is state]
        if not mine:
            return None
        result = self.read(queued.captured, len(queued.states))
        lengths = result.lengths.tolist()
        for r in mine:
            state, length = queued.states[r], lengths[r]
            state.start += length
            state.root = int(result.emitted[r, length - 1])
            if queued.methods[r] != "ar" and queued.nodes:  # a plain round leaves the last tree's scores
                state.scores = result.scores[r]
        return Taken(queued, result, mine)

    def rounds(self, taken: Taken, started: float) -> dict[int, Round]:
        """A taken result as each request's round; the verified nodes and the accepted ones feed the budget's
        calibration, the round's size and time its bookkeeping."""
        backend, queued, result, mine = self.backend, *taken
        phases = dict.fromkeys(PHASES, 0.0)
        phases["verify"] = time.perf_counter() - started  # the whole round, up to its one wait
        verified = np.arange(result.scores.shape[1]) < result.nodes[:, None]
        accepted = np.zeros_like(verified)
        lengths = result.lengths.tolist()
        for r, length in enumerate(lengths):
            accepted[r, result.path[r, 1:length] - 1] = True
        out = {queued.seq_ids[r]: Round(result.emitted[r, :lengths[r]].tolist(), int(result.nodes[r]), lengths[r] - 1,
                                        phases) for r in mine}
        backend.calibration.observe(result.scores[verified], accepted[verified])
        backend.last_nodes = int(result.nodes.sum())
        if backend.choice is not None:
            backend.last_predicted = float(self.predicted(len(queued.states), [queued.nodes], queued.budget)[0])
            backend._previous = (started, len(mine), queued.nodes > 0, int(result.lengths[mine].sum()),
                                 backend.last_predicted - backend.cost.overhead)
        return out

    def predicted(self, requests: int, sizes: list[int], budget: int) -> np.ndarray:
        """Seconds a round of `requests` requests takes at each tree size: its measured time (`capture_all`) plus
        the host's share the batch measures while serving (the cost model's overhead), or the cost model's where
        a size was not measured."""
        backend = self.backend
        bucket = request_bucket(requests, backend.max_seqs)
        measured = [self.seconds.get((bucket, self._tree_nodes(n), budget)) for n in sizes]
        if None not in measured:
            return np.array(measured) + backend.cost.overhead
        return backend.cost.seconds_at(np.array([self.rows(requests, n) for n in sizes]), requests)

    def size(self, states: list[SeqState], node_limit: int | None, drafts: bool = True) -> tuple[int, int] | None:
        """(nodes a tree verifies, the trees' budget) for this round, or None where it takes the host path: a
        request that is not `ddtree`, `dflash` or `ar` with picks the device makes (`picks_on_device`), or no tree
        that fits the step's rows. A round with nothing to draft (every request `ar`, or `drafts` off) is PLAIN:
        each request's root alone. Else the size is the power of two up to the largest budget (a `dflash` chain's:
        the draft depth) or that budget that maximises expected tokens per second (`predicted`), each request's
        expected accepted tokens from its tree (or chain) as last read (with overlap, the round before the one
        queued), calibrated."""
        backend = self.backend
        for state in states:
            request = state.request
            if (request.method not in ("ddtree", "dflash", "ar") or not picks_on_device(state)
                    or request.params.logprobs is not None):
                return None
        trees = [min(state.request.budget, backend.max_tree) for state in states if state.request.method == "ddtree"]
        budgets = trees + [self.depth for state in states if state.request.method == "dflash"]
        if not drafts or not budgets or max(budgets) < 1:
            return PLAIN
        # the smallest budget captured at start-up that holds them all, and its sizes up to the first that does: a
        # best-first tree's first n nodes are the same at any budget, so no round waits for a capture
        need, limit = max(budgets), min(node_limit or backend.max_rows, backend.max_rows)
        budget = min((b for b in self.budgets if b >= need), default=need)
        sizes = {budget, *(1 << i for i in range(budget.bit_length()))}
        top = min(n for n in sizes if n >= need)
        sizes = [n for n in sorted(sizes, reverse=True) if n <= top and self.rows(len(states), n) <= limit]
        if not sizes:
            return None
        known = [state.scores for state in states if state.scores is not None]
        if len(sizes) == 1 or not known:
            return sizes[0], budget
        width = min(len(scores) for scores in known)
        gains = np.cumsum(backend.calibration(np.stack([scores[:width] for scores in known])), axis=1).mean(axis=0)
        expected = len(states) + len(budgets) * gains[np.minimum(sizes, width) - 1]  # each one's first n nodes
        rates = expected / self.predicted(len(states), sizes, budget)
        return sizes[int(np.argmax(rates))], budget

    def rows(self, requests: int, nodes: int) -> int:
        """Target rows a round of `requests` requests at `nodes` nodes a tree verifies (padding included)."""
        return request_bucket(requests, self.backend.max_seqs) * (self._tree_nodes(nodes) + 1)

    def replay(self, starts: np.ndarray, roots: np.ndarray, allowed: np.ndarray, depths: np.ndarray,
               sampling: np.ndarray, tables: list[list[int]], nodes: int, budget: int,
               chains: np.ndarray | None = None) -> _Captured:
        """Queue one round of these requests (their starts, roots, node allowances, draft depths, sampling settings
        [count, 4]: temperature (0: greedy), top-k, top-p, min-p; and block tables), each verifying at most the
        first `nodes` draft nodes of its best-first tree of budget `budget` (>= nodes: the result holds every
        node's score, for the next round's choice of size), or where `chains` says so of its chain (`dflash`)."""
        count = len(starts)
        bucket = request_bucket(count, self.backend.max_seqs)
        filtered = bool(((sampling[:, 1] > 0) | (sampling[:, 2] < 1) | (sampling[:, 3] > 0)).any())
        picks: Picks = "filtered" if filtered else "sampled" if (sampling[:, 0] > 0).any() else "greedy"
        chained = chains is not None and bool(chains.any())
        key = (bucket, self._tree_nodes(nodes), budget, picks, chained)
        captured = self._rounds.get(key) or self._capture_idle(key)
        io = captured.rows
        host = np.zeros((bucket, INPUTS + self.width), dtype=np.int64)
        host[:, 3] = -1
        host[:count, 0], host[:count, 1], host[:count, 2], host[:count, 3] = starts, roots, allowed, depths
        host[:count, 4] = sampling[:, 0].copy().view(np.int64)
        host[0, 5] = self._seeds.integers(1 << 62)  # fresh Philox draws every round
        host[:count, 6] = sampling[:, 1]
        host[:count, 7], host[:count, 8] = sampling[:, 2].copy().view(np.int64), sampling[:, 3].copy().view(np.int64)
        if chained:
            host[:count, 9] = chains
        for r, table in enumerate(tables):
            host[r, INPUTS:INPUTS + len(table)] = table[:self.width]
        io.inputs.copy_(torch.from_numpy(host), non_blocking=True)
        captured()
        return captured

    def read(self, captured: _Captured, count: int) -> RoundResult:
        """The result of the round last replayed on `captured` (the host waits for it here), its first `count`
        requests'."""
        out = captured.rows.result.cpu().numpy()[:count]
        ints, block = out[:, :2 + 2 * self.backend.block].astype(np.int64), self.backend.block
        return RoundResult(ints[:, 0], ints[:, 1], ints[:, 2:2 + block], ints[:, 2 + block:], out[:, 2 + 2 * block:])

    def _tree_nodes(self, nodes: int) -> int:
        """Nodes a tree of budget `nodes` holds at this drafter's depth and vocabulary."""
        vocab = self.backend.draft_head.weight.shape[0]
        return tree_size(self.depth, min(nodes, vocab), nodes)

    def _capture_idle(self, key: tuple[int, int, int, Picks, bool]) -> _Captured:
        """The round of `key`, captured on dummy requests (they write only the scratch slot): a capture runs its round
        three times (two warm-up runs, then the replay), and the live requests' round must run once. Without CUDA
        there is nothing to capture, and the round runs eagerly when replayed."""
        bucket, nodes, budget, picks, chains = key
        io = _RoundIO(self.backend, bucket, nodes, self._tree_nodes(budget), budget, self.width, picks, chains)
        captured = _Captured(lambda rows: _round(self.backend, rows), io, self.backend.cuda, self.backend.pool)
        io.inputs[:, 3] = -1  # until replayed: a timing replay (`capture_all`) runs dummy requests too
        if self.backend.cuda:
            captured()
        self._rounds[key] = captured
        return captured

    def capture_all(self, budget: int, repeats: int = 3) -> None:
        """Capture every bucket's round at every size the batch may choose under `budget`, and time each (the least
        of `repeats` replays; none with 0: without the batch budget every request verifies its own budget) for
        `predicted`: before any sequence runs, so dummy requests write only the scratch slot (their attention
        reads no context: a round's own cost, less its requests' context lengths)."""
        sizes = {budget, *(1 << i for i in range(budget.bit_length()))}
        self.budgets.add(budget)
        largest = self.backend.max_seqs
        for bucket in sorted({request_bucket(n, largest) for n in range(1, largest + 1)}):
            for nodes, tree_budget in [PLAIN, *((n, budget) for n in sorted(sizes) if n <= budget)]:
                if self.rows(bucket, nodes) > self.backend.max_rows:
                    continue
                key = (bucket, self._tree_nodes(nodes), tree_budget, "greedy", False)
                if key not in self._rounds:
                    captured = self._capture_idle(key)
                    if repeats:
                        self.seconds[key[:3]] = min(self._timed(captured) for _ in range(repeats))

    def _timed(self, captured: _Captured) -> float:
        """Seconds of one replay, from an idle device to its end."""
        if self.backend.cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        captured()
        if self.backend.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started


class _Captured(Captured):
    rows: _RoundIO


class _RoundIO:
    """A round's static buffers: its inputs and result, and the draft and verify forwards' rows."""

    def __init__(self, backend: RoundBackend, bucket: int, nodes: int, tree: int, budget: int, width: int,
                 picks: Picks, chains: bool) -> None:
        device, block = backend.device, backend.block
        self.bucket, self.nodes, self.budget, self.width, self.picks = bucket, nodes, budget, width, picks
        self.chains = chains  # some request verifies a chain: `dflash` (graphs without chains skip that step)
        self.inputs = torch.zeros((bucket, INPUTS + width), dtype=torch.long, device=device)
        self.result = torch.zeros((bucket, 2 + 2 * block + tree), dtype=torch.float64, device=device)
        rows = nodes + 1
        self.draft = _layout_rows(bucket, block, width, backend)
        self.draft.rule_visible = {rule: torch.zeros_like(self.draft.visible)
                                   for rule in backend.fused_draft.block_visible}
        self.draft.repeat_visibility(block, backend.fused_draft.block_visible)
        self.verify = _layout_rows(bucket, rows, width, backend)
        self.verify.vis_offsets.copy_(torch.arange(bucket, device=device) * rows * rows)
        self.verify.starts, self.verify.tables = self.draft.starts, self.draft.tables  # one request, one layout


def _layout_rows(bucket: int, per_request: int, width: int, backend: RoundBackend) -> StaticRows:
    """Static rows of `bucket` requests with `per_request` rows each, back to back (a fixed layout)."""
    block_m = tile_rows(per_request)
    rows = StaticRows(bucket * per_request, bucket, width, bucket * per_request * per_request, backend.scratch,
                      backend.device, block_m=block_m)
    offsets = np.arange(bucket + 1, dtype=np.int64) * per_request
    rows.row_offsets.copy_(torch.from_numpy(offsets.astype(np.int32)))
    rows.tiles = torch.from_numpy(tiles_for(offsets.tolist(), rows.tiles.shape[0], block_m)).to(backend.device)
    return rows


def _slots(tables: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """Pool slots of cache positions [S, n] through each request's block table [S, W]."""
    return tables.gather(1, (positions // page).clamp(max=tables.shape[1] - 1)) * page + positions % page


def _chains(logp: torch.Tensor, tok: torch.Tensor, chain: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
            depths: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The trees (tokens [S, N], parents and depths [S, N + 1], scores [S, N]) with the `chain` requests' rows
    replaced by their chains: node j the top token at depth j (of the drafter's [S, D, k] top log-probs `logp`
    and tokens `tok`), under node j - 1, scored by the chain's prefix log-probability; none past depth D."""
    depth, width, device = tok.shape[1], tokens.shape[1], tok.device
    node = torch.arange(1, width + 1, device=device)
    at = node.clamp(max=depth) - 1
    chain_scores = logp[:, :, 0].cumsum(dim=1)[:, at].masked_fill(node > depth, float("-inf"))
    steps = torch.cat([node.new_zeros(1), node])
    rows = chain[:, None]
    return (torch.where(rows, tok[:, at, 0], tokens), torch.where(rows, (steps - 1).clamp(min=0), parents),
            torch.where(rows, steps.clamp(max=depth), depths), torch.where(rows, chain_scores.to(scores.dtype), scores))


def _trees(backend: RoundBackend, io: _RoundIO, start: torch.Tensor, root: torch.Tensor, draft_depth: torch.Tensor,
           drafting: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A round's draft pass and each request's tree, cut to its first `io.nodes` nodes: tokens [S, n], scores
    [S, n], parents and depths [S, n + 1], and every node's score for the next round's choice of size."""
    device, page, scratch = backend.device, backend.page, backend.scratch
    bucket, nodes, block, depth = io.bucket, io.nodes, backend.block, backend.block - 1
    # draft: every request's block at its start
    steps = torch.arange(block, device=device)
    positions = start[:, None] + steps
    mask_id = backend.draft.config.mask_token_id
    io.draft.ids.copy_(torch.where(steps == 0, root[:, None], mask_id).flatten())
    io.draft.positions.copy_(positions.flatten())
    io.draft.slots.copy_(torch.where(drafting[:, None], _slots(tables, positions, page), scratch).flatten())
    rules = backend.fused_draft.block_visible
    drafted = backend._draft_rows(io.draft.ids, io.draft.positions, io.draft.slots, {
        rule: io.draft.mask(page, rule[0], io.draft.rule_visible[rule]) for rule in rules})
    drafted = drafted.view(bucket, block, -1)[:, 1:]

    # trees: each request's best-first tree, its first `nodes` nodes, within its allowance and depth
    k = min(io.budget, drafted.shape[-1])
    logp, tok = vocab_top(drafted.reshape(bucket * depth, -1), k, backend.draft_head.token_ids)
    logp = logp.view(bucket, depth, k).masked_fill(
        torch.arange(depth, device=device)[None, :, None] >= draft_depth.clamp(min=0)[:, None, None], float("-inf"))
    tok = tok.view(bucket, depth, k)
    tokens, parents, depths, tree = batch_prefixes(logp, tok, io.budget)
    if io.chains:  # a `dflash` request's tree is its chain: each depth's most probable token, under the one above
        tokens, parents, depths, tree = _chains(logp, tok, io.inputs[:, 9] > 0, tokens, parents, depths, tree)
    tokens, scores, parents, depths = tokens[:, :nodes], tree[:, :nodes], parents[:, :nodes + 1], depths[:, :nodes + 1]
    return tokens, scores, parents, depths, tree


def _round(backend: RoundBackend, io: _RoundIO) -> None:
    """The round itself (module docstring), on static buffers, with no host synchronisation."""
    device, page, scratch = backend.device, backend.page, backend.scratch
    bucket, nodes, block, depth = io.bucket, io.nodes, backend.block, backend.block - 1
    start, root, allowed, draft_depth = (io.inputs[:, i] for i in range(4))
    temperature, top_p, min_p = (io.inputs[:, i].contiguous().view(torch.float64).float() for i in (4, 7, 8))
    tables = io.inputs[:, INPUTS:]
    live = draft_depth >= 0
    drafting = live & (allowed > 0)  # an `ar` request's block rows write nothing: it has no rows reserved for them
    io.draft.starts.copy_(start)
    io.draft.tables.copy_(tables)
    if nodes:
        tokens, scores, parents, depths, tree = _trees(backend, io, start, root, draft_depth, drafting, tables)
    else:  # a plain round: each request's root alone
        tokens, parents = root.new_zeros((bucket, 0)), root.new_zeros((bucket, 1))
        depths, tree = parents, torch.zeros((bucket, 0), dtype=io.result.dtype, device=device)
        scores = tree
    node = torch.arange(nodes + 1, device=device)
    drafts = (scores > float("-inf")) & (node[None, 1:] <= allowed[:, None])
    exists = torch.cat([live[:, None], drafts & live[:, None]], dim=1)

    # verify: root and nodes as rows start.., each seeing its ancestors
    ids = torch.cat([root[:, None], tokens], dim=1)
    io.verify.ids.copy_(ids.flatten())
    io.verify.positions.copy_((start[:, None] + depths).clamp(max=backend.max_context - 1).flatten())
    io.verify.slots.copy_(torch.where(exists, _slots(tables, start[:, None] + node, page), scratch).flatten())
    visible = ancestors(parents, depth)
    io.verify.visible.copy_(visible.flatten().to(torch.int8))
    logits, taps = backend._target_rows(io.verify.ids, io.verify.positions, io.verify.slots, io.verify.mask(page))
    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values[:, None].expand(bucket, nodes + 1).reshape(-1)

    if io.picks == "greedy":
        picks = vocab_argmax(logits).view(bucket, nodes + 1)
    else:
        floor = None
        if io.picks == "filtered":  # greedy rows' floors (temperature 1 here) go unread
            floor = filter_floor(logits, per_row(torch.where(temperature > 0, temperature, 1.0)),
                                 per_row(io.inputs[:, 6]), per_row(top_p), per_row(min_p), FILTER_CAP)
        picks = vocab_sample(logits, per_row(temperature), io.inputs[:1, 5], floor).view(bucket, nodes + 1)

    # walk: accepted nodes form one root path, one node per depth
    matches = (ids == picks.gather(1, parents)) & exists
    matches[:, 0] = True
    accepted = ~(visible & ~matches[:, None, :]).any(dim=2) & exists
    length = accepted.sum(dim=1)
    at_depth = torch.where(accepted, depths, depth + 1)  # the rejected land in a dropped last column
    path = torch.zeros((bucket, depth + 2), dtype=torch.long, device=device).scatter_(
        1, at_depth, node.expand(bucket, -1))[:, :depth + 1]
    emitted = picks.gather(1, path)

    # commit: the path's rows down to start.. in the target's pool (a plain round's root is where it belongs);
    # their taps into the drafter's context
    steps = torch.arange(depth + 1 if nodes else 1, device=device)
    walked = path[:, :steps.shape[0]]
    kept = (steps < length[:, None]) & live[:, None]
    if nodes:
        moved = kept & (walked != steps)
        src = torch.where(moved, _slots(tables, start[:, None] + walked, page), scratch).flatten()
        dst = torch.where(moved, _slots(tables, start[:, None] + steps, page), scratch).flatten()
        backend.kv.index_copy_(3, dst, backend.kv.index_select(3, src))
    rows = torch.where(kept, torch.arange(bucket, device=device)[:, None] * (nodes + 1) + walked, 0).flatten()
    context = (start[:, None] + steps).clamp(max=backend.max_context - 1)
    slots = torch.where(kept, _slots(tables, context, page), scratch).flatten()
    kv = backend.fused_draft.context(backend.ops, backend.draft, taps.index_select(0, rows),
                                     *backend.draft_rope(context.flatten()))
    backend.draft_kv.index_copy_(3, slots, kv)
    io.result[:, :2 + 2 * block].copy_(torch.cat([length[:, None], (exists.sum(dim=1) - 1)[:, None], emitted, path],
                                                 dim=1))
    io.result[:, 2 + 2 * block:].copy_(tree.masked_fill(~live[:, None], float("-inf")))
