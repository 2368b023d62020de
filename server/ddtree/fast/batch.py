"""The batched fast path: many sequences' rounds in one drafter pass and one target forward, over paged caches.

Each step (engine/batch.py schedules it):

    prefill  the prompt chunks of the sequences entering, as one causal forward of all their rows; the last
             chunk of a new sequence picks its first token
    draft    one DFlash block pass for every drafting sequence's block, each over its own context rows
    tree     each sequence's best-first tree from its top candidates at its own budget; then the batch budget
             (core/budget.py) keeps the round's most probable prefixes across all sequences, as many as maximise
             expected committed tokens per second under the cost model measured on this device
    verify   one target forward over every sequence's root and tree (each row sees its own sequence's committed
             slots and its ancestors only: kernels/paged_attention.py); each sequence's picks, with its own
             sampling settings, logit processors and grammar, then the walk
    commit   each sequence keeps its accepted path's rows and extends its drafter context

The target's and the drafter's caches are pools of slots shared by every sequence through the block tables of
core/blocks.py (one table per sequence serves both pools). The layers are the single-sequence fast path's
(fast/layers.py), so each row is computed as it is there. On CUDA the draft and verify forwards are replayed as
CUDA graphs, one per bucket of rows (`Captured`); elsewhere they run eagerly. A round of `ddtree` or `ar` requests
that are greedy or unseeded samples, on a dense target with a DFlash drafter, runs whole on the device instead (one
graph per bucket of requests and tree size, fast/batch_round.py); the host path above serves every other round.

Scope: dense and mixture-of-experts Qwen3 / Llama targets and Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids (a Gated
DeltaNet state per sequence: fast/paged_hybrid.py), with any drafter, greedy or sampled with any request settings.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from ddtree.core.blocks import BlockManager
from ddtree.core.budget import FLAT, Calibration, CostModel, RoundChoice, choose_nodes
from ddtree.core.rounds import PHASES, DecodeRequest, Prefill, Round
from ddtree.core.sampling import History, make_generator, pick_tokens
from ddtree.core.tree import selector_chain_tree, selector_tree_from_sorted
from ddtree.fast.batch_cost import measure_cost
from ddtree.fast.batch_round import DeviceRound
from ddtree.fast.batch_rows import Captured, ContextRows, StaticRows, buckets
from ddtree.fast.batch_seq import SeqState, logprob_rows, processed_logits, round_picks
from ddtree.fast.batch_trees import RoundTrees, accepted_paths, dflash_trees
from ddtree.fast.dflash2 import SelectorDraft
from ddtree.fast.hybrid import PROMPT_CHUNK
from ddtree.fast.layers import Draft, Ops, TargetLayer, decoder_layer
from ddtree.fast.paged_hybrid import BatchRecord, HybridRows, SeqRows, VarlenRows
from ddtree.fast.plan import lap
from ddtree.fast.prompt import bucket_for
from ddtree.fast.rope import RopeTable
from ddtree.fast.runner import MAX_BUDGET, PooledPrompt
from ddtree.kernels import gdn
from ddtree.kernels.fp8 import Fp8Weight
from ddtree.kernels.gather import embed
from ddtree.kernels.gemm import linear, prompt_rows
from ddtree.kernels.heads import attention_heads as heads_kernel
from ddtree.kernels.invariant import for_fp8_targets
from ddtree.kernels.jit import triton_works
from ddtree.kernels.paged_attention import PagedLayout, PagedMask, kernel_works, paged_mask, tile_rows
from ddtree.models.draft import DFlashDraft
from ddtree.models.draft_vocab import DraftHead
from ddtree.models.target import HybridTarget, Target
from ddtree.switches import SWITCHES

# Prompt rows a step replays from a verify graph (`_replays_prefill`), which computes every row's logits: up to here
# that costs about a millisecond; a longer prompt step is compute-bound, and its launches hide behind it.
PREFILL_GRAPH_ROWS = 512


class PagedBackend:
    """Batched rounds over paged caches for a dense or hybrid target (+ its drafter)."""

    name = "fast"
    chunked = True
    paged = True
    prompt_only = False

    @staticmethod
    def declines(target: Target, draft: DFlashDraft | None) -> str | None:
        """Why this pair would not batch on the paged fast path (None when it would): what it declines would
        otherwise batch on the eager reference path, many times slower than one request at a time here."""
        if isinstance(target, HybridTarget) and not all(
                gdn.varlen_takes(layer.linear_attn) for layer in target.layers if hasattr(layer, "linear_attn")):
            return "hybrids whose Gated DeltaNet layers the varlen kernels do not take do not batch yet"
        if not all(kernel_works(target.device, d) for d in _head_dims(target, draft)):
            return "the paged attention kernel does not build on this device"
        return None

    def __init__(self, target: Target, draft: DFlashDraft | None, draft_head: DraftHead | None,
                 blocks: BlockManager, *, max_seqs: int = 64, max_rows: int = 2048, cost: CostModel = FLAT,
                 device_round: bool | None = None) -> None:
        """`device_round`: rounds the device can pick for run whole on it (fast/batch_round.py); None: where they
        replay as CUDA graphs (a dense target with a DFlash drafter, the paged kernels, a GPU)."""
        cfg = target.config
        self.target, self.draft, self.draft_head, self.blocks, self.cost = target, draft, draft_head, blocks, cost
        self.model, self.device, self.dtype = target.model.model, target.device, target.dtype
        self.eps = cfg.rms_norm_eps
        self.ops = Ops(compile=self.device.type == "cuda")
        head_dims = _head_dims(target, draft)
        if triton_works(self.device):
            self.ops.take_row_kernels()
            if all(d & (d - 1) == 0 for d in head_dims):
                self.ops.attention_heads = heads_kernel
        # a hybrid's recurrent layers keep a state per sequence (fast/paged_hybrid.py); only attention layers page
        self.hybrid = HybridRows(target, self.ops, max_seqs, max_rows) if isinstance(target, HybridTarget) else None
        if self.hybrid and blocks.prefix is not None:  # a hit restores the states checkpointed after its prefix:
            # as many checkpoints as sequences (the memory the server sets aside for them: batch_memory.py), one
            # every prompt piece (a prefill's recurrent layers end a piece there anyway)
            if not blocks.prefix.every:
                blocks.prefix.keep_states(max_seqs, max(1, PROMPT_CHUNK // blocks.block_size))
            self.hybrid.pool.keep_checkpoints(blocks.prefix.checkpoint_slots)
        # a hybrid's trees stay within the varlen Gated DeltaNet kernels' rows (fast/paged_hybrid.py)
        self.max_tree = min(self.hybrid.tree_rows - 1, MAX_BUDGET) if self.hybrid else MAX_BUDGET
        self.layers = [] if self.hybrid else [TargetLayer.of(layer) for layer in self.model.layers]
        self.max_context = target.max_context
        self.target_rope = RopeTable(self.model.rotary_emb, self.max_context, self.dtype, self.device)
        self.max_seqs, self.max_rows = max_seqs, max_rows
        self.scratch = blocks.num_blocks * blocks.block_size  # one block past the pool: padding rows write there
        slots = self.scratch + blocks.block_size
        head_dim = max(_head_dims(target, None))
        attention_layers = len(self.hybrid.hybrid.attention_index) if self.hybrid else len(self.layers)
        self.kv = torch.zeros((attention_layers, 2, cfg.num_key_value_heads, slots, head_dim), dtype=self.dtype,
                              device=self.device)
        self.taps: tuple[int, ...] = ()
        self.block = 1
        self.selector = False  # a DFlash2 drafter: its selector's transitions
        if draft is not None:
            dc = draft.config
            self.taps, self.block = dc.target_layer_ids, dc.block_size
            # a DFlash2 drafter drafts its selector's transition model (fast/dflash2.py)
            self.selector = dc.selector is not None
            self.fused_draft = (SelectorDraft if self.selector else Draft).of(draft)
            # a draft block near the context's end reaches past it (those rows draft nothing that is kept)
            self.draft_rope = RopeTable(draft.rotary, self.max_context + self.block, self.dtype, self.device)
            self.draft_kv = torch.zeros((dc.num_layers, 2, dc.num_kv_heads, slots, dc.head_dim), dtype=self.dtype,
                                        device=self.device)
        self.vocab = target.lm_head.weight.shape[0]
        self.states: dict[int, SeqState] = {}
        self.last_nodes = 0  # draft nodes the last round verified in all (the batch budget's choice)
        self.last_predicted: float | None = None  # seconds the cost model gave the last round (with choice on)
        self.calibration = Calibration()  # what the target accepts of the drafter's forecasts, for the budget
        # Whether a round drafts, from measured step periods (on where the cost model is measured: batch_engine)
        self.choice: RoundChoice | None = None
        self._previous: tuple[float, int, bool, int, float] | None = None  # start, requests, drafted, committed, verify
        self._prefilled = False  # this step ran prompt chunks before its round (its period is not a round's)
        # Forwards over static buffers where the kernels run (CUDA graphs on a GPU); elsewhere SDPA, eagerly.
        self.cuda = self.device.type == "cuda"
        self.static = (all(kernel_works(self.device, d) for d in head_dims)
                       and (self.hybrid is None or self.hybrid.varlen))
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.captured: dict[tuple[str, int], Captured] = {}
        self.buckets = buckets(max_rows)
        pair = draft is not None and not self.hybrid and not self.selector
        self.device_round = DeviceRound(self) if pair and (
            device_round or (device_round is None and self.cuda and self.static)) else None

    # -- the batch backend's interface ---------------------------------------------------------------------

    def accepts(self, request: DecodeRequest) -> bool:
        if request.method != "ar" and self.draft is None:
            return False
        return request.method != "ddtree" or 1 <= request.budget <= MAX_BUDGET

    def open(self, seq_id: int, request: DecodeRequest) -> None:
        params = request.params
        history = History(request.prompt_ids, self.vocab, self.device) if params.penalized else None
        self.states[seq_id] = SeqState(request, generator=make_generator(params, self.device), history=history)
        if self.hybrid:
            self.hybrid.pool.open(seq_id)

    def close(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
        if self.hybrid:
            self.hybrid.pool.close(seq_id)

    def rows_per_round(self, request: DecodeRequest) -> int:
        """A round writes the root and its tree's nodes in the target's cache, the draft block in the drafter's; a
        device round queued before the last one's tokens are taken starts up to a block further on."""
        ahead = self.block if self.device_round is not None and SWITCHES.overlap else 0
        if request.method == "ar":
            return ahead
        depth = self.block - 1
        return max(depth if request.method == "dflash" else min(request.budget, MAX_BUDGET), depth) + ahead

    @torch.inference_mode()
    def step(self, prefills: list[Prefill], decodes: list[int], node_limit: int | None) -> dict[int, Round]:
        out: dict[int, Round] = {}
        self._prefilled = bool(prefills)
        if prefills:
            out.update(self._prefill(prefills))
        if decodes:
            out.update(self._round(decodes, node_limit))
        else:
            self._previous = None
        return out

    # -- prefill -------------------------------------------------------------------------------------------

    @prompt_rows()
    def _prefill(self, chunks: list[Prefill]) -> dict[int, Round]:
        """Every chunk's rows in one causal forward; picks for new sequences whose prompt is now whole."""
        started = time.perf_counter()
        ids, positions, slots, layout = [], [], [], PagedLayout([], [0], [], [])
        for chunk in chunks:
            n = len(chunk.tokens)
            ids += chunk.tokens
            positions += range(chunk.start, chunk.start + n)
            slots += self.blocks.slots(chunk.seq_id, chunk.start, n)
            self._describe(layout, chunk.seq_id, chunk.start, torch.ones(n, n, dtype=torch.bool).tril())
        wanted = [i for i, chunk in enumerate(chunks)
                  if self.states[chunk.seq_id].request.params.prompt_logprobs is not None]
        logit_rows = [r for i in wanted for r in range(layout.row_offsets[i], layout.row_offsets[i + 1])]
        logit_rows += [layout.row_offsets[i + 1] - 1 for i, chunk in enumerate(chunks)
                       if chunk.last and chunk.root is None and i not in wanted]
        if self._replays_prefill(chunks, len(ids), bool(wanted)):  # every row's logits, from a verify's graph
            logits, taps = self._run("verify", ids, positions, slots, layout)
            logit_index = {row: row for row in logit_rows}
        else:
            logit_index = {row: k for k, row in enumerate(logit_rows)}
            saves = (self.hybrid.checkpoints(chunks, self.blocks, self.states) if self.hybrid and self.blocks.prefix
                     else {})
            seqs = self._seq_rows([chunk.seq_id for chunk in chunks], layout, saves=saves)
            logits, taps = self._target_rows(self._tensor(ids), self._tensor(positions), self._tensor(slots),
                                             paged_mask(layout, self.page, self.device), self._tensor(logit_rows),
                                             seqs)
        if self.draft is not None:
            self._extend_draft(taps, list(range(len(ids))), positions, slots)
        out: dict[int, Round] = {}
        for index, chunk in enumerate(chunks):
            state = self.states[chunk.seq_id]
            lo, hi = layout.row_offsets[index], layout.row_offsets[index + 1]
            if state.request.params.prompt_logprobs is not None:
                state.prompt_logits.append(logits[logit_index[lo]:logit_index[lo] + hi - lo])
            state.start = chunk.start + len(chunk.tokens)
            if not chunk.last:
                continue
            if chunk.root is not None:  # resumed after preemption: its next token is already out
                state.root = chunk.root
                continue
            last = logit_index[hi - 1]
            processed = processed_logits(state, logits[last:last + 1], [[]])
            root = int(pick_tokens(processed, state.request.params, state.generator)[0])
            state.root = root
            if state.history is not None:
                state.history.add([root])
            prompt_logits = torch.cat(state.prompt_logits) if state.prompt_logits else None
            state.prompt_logits = []
            out[chunk.seq_id] = Round([root], 0, 0, {"prefill": time.perf_counter() - started},
                                      logprob_rows(state, processed, [root]), prompt_logits, is_prefill=True)
        return out

    def _replays_prefill(self, chunks: list[Prefill], rows: int, prompt_logprobs: bool) -> bool:
        """Whether a step's prompt rows replay a verify forward's CUDA graph (a dense target's, chunks no longer
        than a tree, no prompt logprobs) instead of hundreds of eager launches: on an H100 a step with a prefix hit's
        67 rows beside seven decodes took 33 ms eagerly where the decodes alone take 15 (benchmarks/RESULTS.md)."""
        return (self.static and not self.hybrid and not prompt_logprobs and rows <= PREFILL_GRAPH_ROWS
                and all(len(chunk.tokens) <= MAX_BUDGET + 1 for chunk in chunks))

    # -- one round ------------------------------------------------------------------------------------------

    def _round(self, seq_ids: list[int], node_limit: int | None) -> dict[int, Round]:
        """One round for every decoding sequence: on the device where it takes them (fast/batch_round.py; the round
        it queued last step may hold their results already), the others on the host."""
        started = time.perf_counter()
        states = [self.states[s] for s in seq_ids]
        drafting = {i for i, st in enumerate(states) if st.request.method != "ar" and self._depth(st) > 0}
        drafts = self._drafts(started, len(drafting), len(states)) and bool(drafting)
        out, device = {}, self.device_round if SWITCHES.device_round else None
        if device is not None:
            out = device.step(seq_ids, states, node_limit, started, drafts)
        left = [i for i, s in enumerate(seq_ids) if s not in out and not (device is not None and device.queues(s))]
        if left:
            subset = ([seq_ids[i] for i in left], [states[i] for i in left])
            out.update(self._host_round(*subset, [j for j, i in enumerate(left) if drafts and i in drafting],
                                        node_limit, started))
        return out

    def _host_round(self, seq_ids: list[int], states: list[SeqState], drafting: list[int], node_limit: int | None,
                    started: float) -> dict[int, Round]:
        """The round on the host: draft, trees, verify, walk and commit launched from Python. The host waits for the
        device where it needs its results (the draft's, then the verify's picks), and nowhere else: the commit's work
        runs on while the next step's host work goes on. Phase times are host wall times between those waits."""
        phases = dict.fromkeys(PHASES, 0.0)
        t = started
        drafted = self._draft(seq_ids, states, drafting) if drafting else None
        phases["draft"], t = lap(t, self.cuda and drafted is not None)
        trees = self._trees(states, drafting, drafted, node_limit)
        visible, packed = trees.visibility()
        phases["tree"], t = lap(t, False)
        sizes = trees.sizes.tolist()
        ids, positions, slots, layout = self._verify_rows(seq_ids, states, trees, visible, packed)
        seqs = self._seq_rows(seq_ids, layout, trees)
        record = self.hybrid.record(seqs) if self.hybrid else None
        logits, taps = self._run("verify", ids, positions, slots, layout, seqs, record)
        offsets = layout.row_offsets
        picks, processed = round_picks(states, trees, logits, offsets)
        phases["verify"], t = lap(t, False)
        paths = accepted_paths(trees, picks, offsets)
        if drafting:
            self.calibration.observe(*trees.verified(paths))
        out, accepted_rows, accepted_positions, accepted_slots, moves, lasts = {}, [], [], [], ([], []), []
        for r, (seq_id, state, path) in enumerate(zip(seq_ids, states, paths, strict=True)):
            lo = offsets[r]
            emitted = picks[[lo + node for node in path]].tolist()
            rows = None
            if state.request.params.logprobs is not None:
                rows = logprob_rows(state, processed.get(r, logits[lo:offsets[r + 1]])[path], emitted)
            # commit: the path's rows move down to start.. in the target's cache; their taps feed the drafter
            for j, node in enumerate(path):
                if node != j:
                    moves[0].append(int(slots[lo + node]))
                    moves[1].append(int(slots[lo + j]))
            accepted_rows += [lo + node for node in path]
            lasts.append(path[-1])
            accepted_positions += range(state.start, state.start + len(path))
            accepted_slots += slots[lo:lo + len(path)].tolist()
            state.start += len(path)
            state.root = emitted[-1]
            if state.history is not None:
                state.history.add(emitted)
            out[seq_id] = Round(emitted, sizes[r], len(path) - 1, phases, rows)
        if moves[0]:
            src, dst = self._tensor(moves[0]), self._tensor(moves[1])
            self.kv.index_copy_(3, dst, self.kv.index_select(3, src))
        if record is not None:
            self.hybrid.commit(record, seqs, lasts)
        if self.draft is not None and any(state.request.method != "ar" for state in states):  # drafter context
            self._extend_draft(taps, accepted_rows, accepted_positions, accepted_slots)
        phases["commit"], _ = lap(t, False)
        self.last_nodes = int(trees.sizes.sum())
        if self.choice is not None:
            self.last_predicted = self.cost.seconds(len(ids), len(states))
            self._previous = (started, len(states), bool(drafting), len(accepted_rows),
                              self.last_predicted - self.cost.overhead)
        return out

    def _verify_rows(self, seq_ids: list[int], states: list[SeqState], trees: RoundTrees,
                     visible: list[torch.Tensor], packed: np.ndarray,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, PagedLayout]:
        """Every sequence's root and tree nodes as the verify's rows, sequence after sequence, from the trees' arrays
        at once: ids, positions (start + depth) and cache slots (its rows' at start, start + 1, ...); and their
        layout."""
        count = trees.sizes + 1
        kept = np.arange(trees.parents.shape[1])[None] < count[:, None]
        roots = np.fromiter((state.root for state in states), np.int64, len(states))
        starts = np.fromiter((state.start for state in states), np.int64, len(states))
        ids = np.concatenate([roots[:, None], trees.tokens], axis=1)[kept]
        positions = (starts[:, None] + trees.depths)[kept]
        slots, offsets = self.blocks.slots_of(seq_ids, starts, count)
        tables = [self.blocks.tables[seq_id] for seq_id in seq_ids]
        return ids, positions, slots, PagedLayout(starts.tolist(), offsets, tables, visible, packed)

    def _drafts(self, now: float, candidates: int, requests: int) -> bool:
        """Whether this round of `requests` sequences, `candidates` of them able to draft, drafts (`RoundChoice`,
        where on), after booking the last round's step period: from its start to this one's, unless prompt chunks
        ran in between. The cost model takes the overhead measured at this round's batch size."""
        if self.choice is None:
            return True
        if self._previous is not None and not self._prefilled:
            started, requests, drafted, committed, verify = self._previous
            self.choice.observe(requests, drafted, now - started, committed, verify if drafted else None)
        self.cost = replace(self.cost, overhead=self.choice.overhead_at(requests))
        return candidates > 0 and self.choice.drafts(requests)  # measured by all the step's sequences

    def _depth(self, state: SeqState) -> int:
        """Draft depth this round: the block's, less what the context has left."""
        return max(0, min(self.block - 1, self.max_context - 1 - state.start))

    def _draft(self, seq_ids: list[int], states: list[SeqState],
               drafting: list[int]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block pass of every drafting sequence: [root, mask x D] at start.. over its context rows ->
        logits [S, D, V] over the draft head's tokens; for a DFlash2 drafter, its selector's transition models
        (SelectorDraft.batch_transitions)."""
        mask_id = self.draft.config.mask_token_id
        block_visible = torch.ones(self.block, self.block, dtype=torch.bool)  # each layer's rule: _draft_rows
        starts = np.fromiter((states[i].start for i in drafting), np.int64, len(drafting))
        ids = np.full((len(drafting), self.block), mask_id, dtype=np.int64)
        ids[:, 0] = [states[i].root for i in drafting]
        drafting_ids = [seq_ids[i] for i in drafting]
        slots, offsets = self.blocks.slots_of(drafting_ids, starts, np.full(len(drafting), self.block))
        tables = [self.blocks.tables[seq_id] for seq_id in drafting_ids]
        positions = (starts[:, None] + np.arange(self.block)).reshape(-1)
        layout = PagedLayout(starts.tolist(), offsets, tables, [block_visible] * len(drafting))
        out = self._run("draft", ids.reshape(-1), positions, slots, layout)
        if not self.selector:
            return out.view(len(drafting), self.block, -1)[:, 1:]
        logits, h = (o.view(len(drafting), self.block, -1)[:, 1:] for o in out)
        roots = self._tensor([states[i].root for i in drafting])
        return self.fused_draft.batch_transitions(h, logits, self.draft_head, roots)

    def _trees(self, states: list[SeqState], drafting: list[int],
               drafted: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
               node_limit: int | None) -> RoundTrees:
        """Every drafting sequence's best-first tree (a chain for `dflash`) at its own budget, over its draft logits
        (all in one call: fast/batch_trees.py) or its DFlash2 transition model, cut to the nodes the batch budget
        keeps."""
        if drafted is None:
            return RoundTrees.empty(len(states))
        depths = [self._depth(states[i]) for i in drafting]
        methods = [states[i].request.method for i in drafting]
        budgets = [min(states[i].request.budget, self.max_tree) for i in drafting]
        if self.selector:
            ordered, order, tokens = drafted
            ordered, order, tokens = ordered.cpu().double().tolist(), order.cpu().tolist(), tokens.cpu().tolist()
            models = [(ordered[slot][:depth], order[slot][:depth], tokens[slot][:depth])
                      for slot, depth in enumerate(depths)]
            part = RoundTrees.of([selector_chain_tree(*model) if method == "dflash" else
                                  selector_tree_from_sorted(*model, budget)
                                  for model, method, budget in zip(models, methods, budgets, strict=True)])
        else:
            part = dflash_trees(drafted, methods, budgets, depths, self.draft_head.token_ids)
        trees = RoundTrees.empty(len(states), part.tokens.shape[1])
        trees.put(drafting, part)
        available = int(trees.sizes.sum())
        limit = available if node_limit is None else min(node_limit, available)
        trees.cut(choose_nodes(trees.live_scores(), self.cost, range(limit + 1), self.calibration))
        return trees

    def pooled_prompt(self, seq_id: int, cached: int, length: int) -> PooledPrompt:
        """A sequence's prompt of `length` tokens as the single-request path reads (its first `cached`: whole pages)
        and writes (the rest) it in this pool (engine/solo.py); its blocks are reserved."""
        pages = self._tensor(self.blocks.tables[seq_id][:cached // self.page])  # the cache holds whole blocks
        return PooledPrompt(self.kv, self.draft_kv if self.draft is not None else None,
                            self._tensor(self.blocks.slots(seq_id, cached, length - cached)), cached, pages, self.page)

    def measure_cost(self, repeats: int = 3) -> CostModel:
        """The round's cost model on this device (fast/batch_cost.py)."""
        return measure_cost(self, repeats)

    def capture_all(self) -> None:
        """Capture every bucket's verify forward, and the draft forward for every batch of blocks, before any
        sequence runs (the pools are empty, so dummy rows may write any slots): the server does this before it
        says it is ready, so no request waits for a capture. Nothing to capture without the kernels."""
        if not self.static:
            return
        dummy = PagedLayout([0], [0, 1], [[0]], [torch.ones(1, 1, dtype=torch.bool)])

        def widest(rows: int) -> int:  # the bucket a forward of `rows` rows (or of the most there are) pads to
            return bucket_for(min(rows, self.buckets[-1]), self.buckets)

        for bucket in self.buckets:
            self._capture("verify", bucket).rows.fill([0], [0], [self.scratch], dummy)
            self.captured[("verify", bucket)]()
            if bucket <= widest(self.max_seqs):  # a decode step's rows: one a sequence
                self._capture("decode", bucket).rows.fill([0], [0], [self.scratch], dummy)
                self.captured[("decode", bucket)]()
        if self.draft is not None:
            for bucket in self.buckets:
                if self.block <= bucket <= widest(self.max_seqs * self.block):
                    self._capture("draft", bucket).rows.fill([0], [0], [self.scratch], dummy)
                    self.captured[("draft", bucket)]()
            taps = torch.zeros((1, len(self.taps) * self.target.config.hidden_size), dtype=self.dtype,
                               device=self.device)
            for bucket in self.buckets:
                self._capture_context(bucket, taps.shape[1]).rows.fill(taps, [0], [0], [self.scratch])
                self.captured[("context", bucket)]()

    # -- forwards -------------------------------------------------------------------------------------------

    def _describe(self, layout: PagedLayout, seq_id: int, start: int, visible: torch.Tensor) -> None:
        """Add a sequence's new rows (their visibility among themselves) to a forward's layout."""
        layout.starts.append(start)
        layout.row_offsets.append(layout.row_offsets[-1] + visible.shape[0])
        layout.tables.append(self.blocks.tables[seq_id])
        layout.visible.append(visible)

    @property
    def page(self) -> int:
        return self.blocks.block_size

    def _run(self, kind: str, ids: list[int], positions: list[int], slots: list[int], layout: PagedLayout,
             seqs: list[SeqRows] | None = None, record: BatchRecord | None = None) -> object:
        """The verify ("verify": logits and taps of every row) or draft ("draft": logits of every row) forward over
        these rows: on static buffers padded to a bucket (a CUDA graph on a GPU) where the kernels run, else
        directly."""
        if not self.static:
            ids_t, positions_t, slots_t = self._tensor(ids), self._tensor(positions), self._tensor(slots)
            if kind == "verify":
                return self._target_rows(ids_t, positions_t, slots_t, paged_mask(layout, self.page, self.device),
                                         None, seqs, record)
            return self._draft_rows(ids_t, positions_t, slots_t, {
                rule: paged_mask(self._block_rule(layout, visible), self.page, self.device, rule[0])
                for rule, visible in self.fused_draft.block_visible.items()})
        n = len(ids)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            raise ValueError(f"{n} rows exceed the batched forward's largest bucket ({self.buckets[-1]})")
        if kind == "verify" and n == len(layout.starts):
            kind = "decode"  # a row a sequence (`ar` rounds): graphs whose paged attention takes one-row tiles
        elif kind == "verify" and self.hybrid and max(np.diff(layout.row_offsets), default=0) > gdn.TREE_MAX:
            kind = "wide verify"  # a tree past the varlen kernels' narrow tiles: graphs of its own, made on first use
        forward = self.captured.get((kind, bucket)) or self._capture(kind, bucket)
        if not forward.rows.fits(n, layout):
            raise ValueError(f"a batch of {len(layout.starts)} sequences and {n} rows does not fit its buffers")
        forward.rows.fill(ids, positions, slots, layout, visible=kind != "draft")  # a draft's is fixed
        if record is not None:
            forward.rows.fill_recurrent(seqs, record.sources)
        out = forward()
        if kind != "draft":
            return out[0][:n], (out[1][:n] if out[1] is not None else None)
        return tuple(o[:n] for o in out) if self.selector else out[:n]

    def _capture(self, kind: str, bucket: int) -> Captured:
        """Static rows of `bucket` for "draft", "verify", "decode" (a verify of one row a sequence: its paged
        attention in one-row tiles) or a hybrid's "wide verify" (trees past gdn.TREE_MAX rows)."""
        per_seq = {"draft": self.block, "decode": 1}.get(kind, MAX_BUDGET + 1)
        width = -(-self.max_context // self.page) + 1
        rows = StaticRows(bucket, self.max_seqs, width, bucket * min(bucket, per_seq), self.scratch, self.device,
                          self.hybrid.hybrid.conv_width if self.hybrid else 0, block_m=tile_rows(per_seq))
        if kind != "draft":
            def run(r: StaticRows) -> object:
                if self.hybrid:
                    widest = self.hybrid.tree_rows if kind == "wide verify" else gdn.TREE_MAX
                    varlen = VarlenRows(r.state_slots, r.sources, min(bucket, widest))
                    return self.hybrid.forward(r.ids, r.positions, r.slots, r.mask(self.page), self.kv,
                                               self.target_rope, None, self.hybrid.record([]), self.taps,
                                               varlen=varlen)
                return self._target_rows(r.ids, r.positions, r.slots, r.mask(self.page))
        else:
            rules = list(self.fused_draft.block_visible)
            rows.rule_visible = {rule: torch.zeros_like(rows.visible) for rule in rules}
            rows.repeat_visibility(self.block, self.fused_draft.block_visible)  # every block sees itself by its rule

            def run(r: StaticRows) -> object:
                return self._draft_rows(r.ids, r.positions, r.slots, {
                    rule: r.mask(self.page, rule[0], r.rule_visible[rule]) for rule in rules})
        self.captured[(kind, bucket)] = Captured(run, rows, self.cuda, self.pool)
        return self.captured[(kind, bucket)]

    @for_fp8_targets
    def _target_rows(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: PagedMask,
                     logit_rows: torch.Tensor | None = None, seqs: list[SeqRows] | None = None,
                     record: BatchRecord | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target rows of every sequence: logits [N, V] (only of `logit_rows` when given) and the drafter's taps
        [N, k*H]. A hybrid's recurrent layers take each sequence's rows (`seqs`) from its states: a verify fills
        `record`, a prefill (no record) moves the states past its rows."""
        if self.hybrid:
            return self.hybrid.forward(ids, positions, slots, mask, self.kv, self.target_rope, seqs, record,
                                       self.taps, logit_rows)
        x = embed(self.model.embed_tokens, ids)
        cos, sin = self.target_rope(positions)
        tapped: dict[int, torch.Tensor] = {}
        delta = None
        for i, layer in enumerate(self.layers):
            tapped[i - 1], x, delta = decoder_layer(self.ops, layer, x, delta, self.kv[i], mask, slots, cos, sin,
                                                    self.eps)
        norm = self.model.norm
        h, x = self.ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        tapped[len(self.layers) - 1] = x
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        logits = linear(h, self.target.lm_head.weight, self.target.lm_head.bias)
        taps = torch.cat([tapped[t] for t in self.taps], dim=-1) if self.taps else None
        return logits, taps

    def _seq_rows(self, seq_ids: list[int], layout: PagedLayout, trees: RoundTrees | None = None,
                  saves: dict[int, tuple[tuple[int, int], ...]] | None = None) -> list[SeqRows] | None:
        """A hybrid forward's sequences (fast/paged_hybrid.py `HybridRows.seq_rows`); None for a dense target."""
        return self.hybrid.seq_rows(seq_ids, layout, trees, saves) if self.hybrid else None

    def _block_rule(self, layout: PagedLayout, visible: torch.Tensor) -> PagedLayout:
        """A draft forward's layout with every block's rows seeing one another as a layer's rule shows."""
        return PagedLayout(layout.starts, layout.row_offsets, layout.tables, [visible.cpu()] * len(layout.starts))

    def _draft_rows(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    masks: dict[tuple[int | None, bool], PagedMask]) -> object:
        """The drafter over block rows (each block's rows see its sequence's context and the block rows its
        layer's causality rule shows) -> logits [N, V] over the draft head's tokens (a block's first row's are
        never read); a DFlash2 drafter's also its normed rows [N, H], which its selector reads."""
        dc, fused, ops = self.draft.config, self.fused_draft, self.ops
        x = fused.embed(embed(self.target.embed_tokens, ids))
        cos, sin = self.draft_rope(positions)
        delta = None
        step = fused.layer_step or decoder_layer  # a DFlash2 layer convolves each block's rows
        for i, layer in enumerate(fused.layers):
            mask = masks[fused.rules[i]]
            if fused.sinks[i] is not None:  # the layer's sink logits join its softmax
                mask = replace(mask, sinks=fused.sinks[i])
            _, x, delta = step(ops, layer, x, delta, self.draft_kv[i], mask, slots, cos, sin, dc.rms_norm_eps)
        fp8 = isinstance(self.draft_head.weight, Fp8Weight) and not self.selector  # the selector reads plain rows
        h, _ = ops.normed(x, delta, fused.norm, fused.eps, fp8)
        logits = fused.finish_logits(linear(h, self.draft_head.weight, self.draft_head.bias))
        return (logits, h) if self.selector else logits

    def _extend_draft(self, taps: torch.Tensor, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """Context K/V of committed rows (rows `rows` of a forward's `taps`, at their positions) into the drafter's
        pool: padded to a bucket and replayed as a CUDA graph on a GPU (eagerly it is a dozen launches a step)."""
        bucket = bucket_for(len(rows), self.buckets)
        forward = self.captured.get(("context", bucket)) or self._capture_context(bucket, taps.shape[1])
        forward.rows.fill(taps, rows, positions, slots)
        forward()

    def _capture_context(self, bucket: int, width: int) -> Captured:
        def run(r: ContextRows) -> None:
            kv = self.fused_draft.context(self.ops, self.draft, r.feats, *self.draft_rope(r.positions))
            self.draft_kv.index_copy_(3, r.slots, kv)

        rows = ContextRows(bucket, width, self.scratch, self.dtype, self.device)
        self.captured[("context", bucket)] = Captured(run, rows, self.cuda, self.pool)
        return self.captured[("context", bucket)]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _head_dims(target: Target, draft: DFlashDraft | None) -> set[int]:
    """The attention head dims a batched forward runs at: the target's, and its drafter's."""
    cfg = target.config
    dims = {getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads}
    return dims | ({draft.config.head_dim} if draft is not None else set())
