"""The fast path: DDTree rounds with static buffers, all on the device, replayed as CUDA graphs.

At batch 1 the target's forward is memory-bound, so a round should cost about one read of the weights.
The reference loop (engine.py) loses that to the host: a Python heap, a Python walk, masks built on the
CPU, a growing DynamicCache, and one kernel launch per op. Here one round is four steps over tensors that
never move or change shape:

    draft   the DFlash block pass over a static context cache  -> draft logits [D, V]
    tree    fused top-k, best-first selection of the B most probable prefixes, their visibility (on device)
    verify  our own target forward over a static KV cache with an in-place tree mask, then the greedy walk
    commit  compact the accepted rows' K/V in place, append their taps to the draft cache, advance start

Each step is captured once per (method, budget) as a CUDA graph; the host replays the four graphs and reads
back one small tensor (the accepted length and the emitted tokens). On the CPU the same steps run eagerly,
which is what the tests compare against the reference path: the greedy tokens must be identical.

Scope: greedy or sampled requests (temperature, top-k, top-p, min-p, penalties, logit bias, a grammar,
logprobs, prompt logprobs), on Qwen3 / Llama-family targets and Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids
(Gated DeltaNet layers: fast/hybrid.py), dense or mixture-of-experts (experts in fixed shapes: fast/moe.py);
no sliding windows. Everything else stays on the reference path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from ddtree.core import grammar
from ddtree.core.rounds import DecodeRequest, Round
from ddtree.core.sampling import MAX_TOP_LOGPROBS, SamplingParams, apply_penalties, filter_logits, token_logprobs
from ddtree.fast.dflash2 import SelectorDraft
from ddtree.fast.layers import Draft, Ops, TargetLayer, decoder_layer, decoder_row
from ddtree.fast.plan import Plan, stamp
from ddtree.fast.prompt import PromptGraphs
from ddtree.fast.rope import RopeTable
from ddtree.kernels.attention import tree_mask
from ddtree.kernels.cache import compact
from ddtree.kernels.gather import copy_pages, embed, gather_rows
from ddtree.kernels.gemm import linear, prompt_rows
from ddtree.kernels.gemv import NORM, gemv
from ddtree.kernels.gemv import supported as gemv_supported
from ddtree.kernels.heads import attention_heads as heads_kernel
from ddtree.kernels.invariant import for_fp8_targets
from ddtree.kernels.jit import triton_works
from ddtree.kernels.tree import ancestors, chain, top_prefixes, tree_size, vocab_argmax
from ddtree.kernels.walk import accept
from ddtree.models.draft import DFlashDraft
from ddtree.models.draft_vocab import DraftHead
from ddtree.models.target import Target

__all__ = ["FastPath", "PooledPrompt", "ancestors", "chain", "top_prefixes", "tree_size"]

MAX_BUDGET = 256  # the largest tree the one-program tree build is tested at (its selections grow with B ln B)
MAX_FILTER_SETTINGS = 8  # distinct (top-k, top-p, min-p) settings with their own captured plans

Filters = tuple[int, float, float]  # (top-k, top-p, min-p) of a sampled request, baked into its plans


@dataclass(frozen=True)
class PooledPrompt:
    """A lone request's prompt in the batched path's paged pool (engine/solo.py): the pages of its first `cached`
    tokens, a prefix the prefix cache already holds, and the slots of the rest. The prefill reads those pages
    instead of computing their rows and writes the rows it computes into the slots, so the prompt is there for the
    requests after it, on either path."""

    kv: torch.Tensor  # the target's pool [L, 2, kv, slots, d]
    draft_kv: torch.Tensor | None  # the drafter's context pool, when there is a drafter
    slots: torch.Tensor  # [n - cached] pool slots of the prompt's tokens after the cached prefix
    cached: int  # a whole number of pages: the prefix cache holds full blocks only
    pages: torch.Tensor  # [cached / page] the pool's pages that hold the cached prefix, in order
    page: int  # slots a page

    def __post_init__(self) -> None:
        if self.pages.numel() * self.page != self.cached:
            raise ValueError(f"a cached prefix of {self.cached} tokens is not whole pages of {self.page}")


def sampling_filters(params: SamplingParams) -> Filters | None:
    """A sampled request's (top-k, top-p, min-p), or None when none of them filters anything."""
    if params.greedy or (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0):
        return None
    return max(params.top_k, 0), params.top_p, params.min_p


class FastPath:
    """Static caches and per-(method, budget) step graphs for one target (+ draft); one generation at a time."""

    name = "fast"

    # Its prompt K/V can come from and go to a paged pool (PooledPrompt): its caches hold every layer's K/V and
    # nothing else. A hybrid's recurrent states would need checkpoints at block boundaries as well.
    pools_prompts = True
    # Its prompt's forward is one pass over the static caches, so it replays as a graph per bucket of rows
    # (fast/prompt.py); a hybrid's commits its recurrent states chunk by chunk on the host.
    graphs_prompts = True

    def __init__(self, target: Target, draft: DFlashDraft | None, capacity: int = 4096,
                 draft_head: DraftHead | None = None) -> None:
        cfg = target.config
        self.target, self.draft = target, draft
        # What the draft scores its block with (the engine's: the target's LM head, or a draft vocabulary's rows)
        self.draft_head = draft_head or (DraftHead(target.lm_head) if draft is not None else None)
        self.model = target.model.model
        self.device, self.dtype = target.device, target.dtype
        self.capacity = -(-min(capacity, target.max_context) // 64) * 64  # aligned rows for the attention kernels
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.ops = Ops(compile=self.device.type == "cuda")
        head_dims = {self.head_dim} | ({draft.config.head_dim} if draft is not None else set())
        if triton_works(self.device):
            self.ops.take_row_kernels()
            if all(d & (d - 1) == 0 for d in head_dims):
                self.ops.attention_heads = heads_kernel  # one Triton kernel instead of the compiled three
        self._build_target()
        self.target_rope = RopeTable(self.model.rotary_emb, self.capacity, self.dtype, self.device)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # tokens committed to the caches
        self.root = torch.zeros((), dtype=torch.long, device=self.device)  # last committed token, not cached yet
        self.steps = torch.arange(self.capacity, device=self.device)  # start + steps[:n]: n new rows' cache slots
        self.inv_temperature = torch.ones((), device=self.device)  # 1 / T of the sampled generation running
        # A request's logit bias and penalties, as device buffers its plans read (one plan for every setting):
        # the bias per token, (repetition, frequency, presence), how often each token was emitted, and
        # which tokens the prompt holds. Each tree node adds its own path's tokens on the device.
        self.vocab = vocab = target.lm_head.weight.shape[0]
        self.bias = torch.zeros(vocab, device=self.device)
        self.penalties = torch.tensor([1.0, 0.0, 0.0], device=self.device)
        self.emitted_counts = torch.zeros(vocab, device=self.device)
        self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        self.taps: tuple[int, ...] = draft.config.target_layer_ids if draft is not None else ()
        if draft is not None:
            dc = draft.config
            self.block = dc.block_size
            # The draft block's tokens, [root, mask x D]: the root is its first entry, so committing one writes it
            self.draft_block = torch.full((self.block,), dc.mask_token_id, device=self.device)
            self.root = self.draft_block[0]
            self.fused_draft = (SelectorDraft if dc.selector is not None else Draft).of(draft)  # DFlash2, DFlash
            self.draft_rope = RopeTable(draft.rotary, self.capacity, self.dtype, self.device)
            # Context rows 0..start-1; the current block's rows at start.. (later overwritten by context).
            self.draft_kv = torch.zeros((dc.num_layers, 2, dc.num_kv_heads, self.capacity, dc.head_dim),
                                        dtype=self.dtype, device=self.device)
        # (method, budget, sampled, filters, constrained, adjusted, logprobs) -> its plan; see plan()
        self._plans: dict[tuple[str, int, bool, Filters | None, bool, bool, bool], Plan] = {}
        self._busy = False
        # Queue each round before reading the previous one: on CUDA that overlaps the host's bookkeeping with
        # the device's work; on the CPU a round runs when it is launched, so it would only delay the output.
        self.queue_ahead = self.device.type == "cuda"
        self.prompt_graphs: PromptGraphs | None = None
        if self.graphs_prompts and self.device.type == "cuda":
            self.prompt_graphs = PromptGraphs(self, capture=partial(self._capture, pool=torch.cuda.graph_pool_handle()))

    def _build_target(self) -> None:
        """The target's fused layers and its static K/V cache (a hybrid target builds its own)."""
        self.layers = [TargetLayer.of(layer) for layer in self.model.layers]
        # One-row forwards (AR steps) through Triton GEMVs that fold in the norms and SiLU · up
        # (ddtree/kernels/gemv.py). An fp8 target's one row takes the fp8 GEMM at one row instead (its rows are
        # quantized by the norm's kernel, which the fused GEMV would have to compute before its first tile).
        # A mixture-of-experts layer's router is its MLP's GEMV; the experts then run their own kernels.
        lm_head = self.target.lm_head
        weights, biases = [lm_head.weight], [lm_head.bias]
        for layer in self.layers:
            projections = [layer.qkv, layer.o] + ([layer.gate_up, layer.down] if layer.experts is None else [])
            weights += [p.weight for p in projections] + ([layer.experts.router] if layer.experts is not None else [])
            biases += [p.bias for p in projections]
        self.row_gemv = (triton_works(self.device)
                         and all(isinstance(w, torch.Tensor) and gemv_supported(w) for w in weights)
                         and all(b is None for b in biases))
        self.kv = self._kv_cache(len(self.layers))

    def _kv_cache(self, layers: int) -> torch.Tensor:
        """K and V of every attention layer in one tensor [L, 2, kv, T, d]: compaction is one launch (fast/cache.py)."""
        return torch.zeros((layers, 2, self.kv_heads, self.capacity, self.head_dim), dtype=self.dtype,
                           device=self.device)

    # -- which requests ---------------------------------------------------------------------------------

    def nodes(self, method: str, budget: int) -> int:
        """Rows one verify pass takes (root included)."""
        if method == "ar":
            return 1
        depth = self.block - 1
        if method == "dflash":
            return depth + 1
        return tree_size(depth, self.fused_draft.branching(self.draft_head), budget) + 1

    def accepts(self, request: DecodeRequest) -> bool:
        """Greedy or sampled (temperature, top-k, top-p, min-p: up to MAX_FILTER_SETTINGS distinct filter
        settings), with or without a grammar, penalties, logit bias, logprobs (up to MAX_TOP_LOGPROBS
        alternatives, the API's limit) and prompt logprobs; a budget in 1..MAX_BUDGET; and the whole request
        fits the static caches."""
        p = request.params
        filters = sampling_filters(p)
        known = {key[3] for key in self._plans} - {None}
        if filters is not None and filters not in known and len(known) >= MAX_FILTER_SETTINGS:
            return False
        if self._busy:
            return False
        if p.logprobs is not None and p.logprobs > MAX_TOP_LOGPROBS:  # more alternatives than a round keeps
            return False
        if request.method != "ar" and self.draft is None:
            return False
        if request.method == "ddtree" and not 1 <= request.budget <= MAX_BUDGET:
            return False
        depth = 0 if request.method == "ar" else self.block - 1
        rows = len(request.prompt_ids) + p.max_new_tokens + self.nodes(request.method, request.budget) + depth + 1
        return rows <= self.capacity and rows < self.target.max_context

    # -- the decoding loop ------------------------------------------------------------------------------

    @torch.inference_mode()
    def rounds(self, request: DecodeRequest, pooled: PooledPrompt | None = None) -> Iterator[Round]:
        """The request's rounds on the static caches: the prefill (after the cached prefix of `pooled`, and
        written back to it), then one replayed plan per round."""
        self._busy = True
        try:
            params, constraint = request.params, request.constraint
            sampled, filters = not params.greedy, sampling_filters(params)
            adjusted, logprobs = _adjusted(params), params.logprobs is not None
            plan = self.plan_for(request.method, request.budget, params)
            if adjusted:  # after the captures (their warm-ups count tokens too), before the prefill
                self._load_adjustments(params, request.prompt_ids)
            refill = prefill_noise = None
            if sampled:
                self.inv_temperature.fill_(1.0 / params.temperature)
                generator = None
                if params.seed is not None:
                    generator = torch.Generator(device=self.device).manual_seed(params.seed)
                refill = partial(plan.noise.uniform_, generator=generator)  # fresh noise for every round
                prefill_noise = plan.noise[:1].uniform_(generator=generator)
            before_verify = refill
            if constraint is not None:
                before_verify = partial(self._mask_tree, plan, constraint, refill)
            drafted = self.nodes(request.method, request.budget) - 1
            most = 1 if request.method == "ar" else self.block  # tokens one round can emit
            t0 = time.perf_counter()
            every_row = params.prompt_logprobs is not None
            # a pooled prompt carries the drafter's context too, whatever this request's method
            with_draft = self.draft is not None and (request.method != "ar" or pooled is not None)
            root, root_logprobs, prompt_logits = self.prefill(
                torch.tensor(request.prompt_ids, device=self.device), with_draft=with_draft,
                noise=prefill_noise, filters=filters, allowed=constraint.allowed([[]]) if constraint else None,
                adjusted=adjusted, logprobs=logprobs, every_row=every_row, pooled=pooled)
            yield Round([root], 0, 0, {"prefill": time.perf_counter() - t0}, root_logprobs, prompt_logits,
                        is_prefill=True)
            emitted = 1
            # The next round goes in before this one is read, so the device never waits for the host's
            # bookkeeping; not when this round may reach max_tokens (a stop token wastes the round queued
            # behind it), nor under a grammar, whose masks need this round's tokens.
            queue_ahead = self.queue_ahead and constraint is None
            pending = plan.launch(before_verify, after=stamp(plan.cuda))
            while True:
                ahead = None
                if queue_ahead and emitted + most < params.max_new_tokens:
                    ahead = plan.launch(before_verify, after=pending.stamps[-1])
                result, phases = pending.collect()
                n = result[0]
                emitted += n
                yield Round(result[1:1 + n], drafted, n - 1, phases, pending.logprob_rows)
                pending = ahead or plan.launch(before_verify, after=pending.stamps[-1])
        finally:
            self._busy = False

    def _mask_tree(self, plan: Plan, constraint: grammar.Constraint, refill: Callable | None) -> None:
        """Before a constrained verify: wait for the tree, then mask each node for the grammar state its own
        path leaves (the host's one extra synchronisation per round, which the grammar needs)."""
        if refill is not None:
            refill()
        tokens, parents = (t.tolist() for t in plan.outputs["tree"][:2])
        paths: dict[int, list[int]] = {0: []}

        def path(node: int) -> list[int]:  # the node's tokens below the root
            if node not in paths:
                paths[node] = [*path(parents[node]), tokens[node - 1]]
            return paths[node]

        plan.allowed.copy_(constraint.allowed([path(node) for node in range(len(parents))]), non_blocking=True)

    def plan_for(self, method: str, budget: int, params: SamplingParams) -> Plan:
        """The plan a request with `params` runs on (rounds() uses it; the bench looks its graphs up)."""
        return self.plan(method, budget, not params.greedy, sampling_filters(params), params.grammar is not None,
                         _adjusted(params), params.logprobs is not None)

    def plan(self, method: str, budget: int, sampled: bool = False, filters: Filters | None = None,
             constrained: bool = False, adjusted: bool = False, logprobs: bool = False) -> Plan:
        """The round's steps for (method, budget), greedy or sampled, captured as CUDA graphs on first use.

        A sampled plan owns a uniform-noise buffer, one row per verified node, refilled before every verify:
        the graph turns it into Gumbel noise, so the picks are exact samples of softmax(logits / T), after
        the reference path's own `filter_logits` when the request filters (top-k, top-p, min-p: one plan per
        setting, the temperature stays a device scalar). A constrained plan owns a mask of the tokens each
        node may pick, refilled from the request's grammar before every verify. An adjusted plan adds the
        logit bias and applies the penalties (`adjust`) to every node before it picks, and counts what it
        emits. A logprobs plan also returns, for the accepted path's nodes, the log-probabilities of what they
        emit and of their 20 best tokens (`token_logprobs`), copied to the host with the round's result.
        """
        key = (method, budget if method == "ddtree" else 0, sampled, filters, constrained, adjusted, logprobs)
        if key not in self._plans:
            noise = allowed = None
            if sampled:
                noise = torch.rand((self.nodes(method, budget), self.vocab), device=self.device)
            if constrained:  # packed, as grammar.Constraint.allowed writes them
                allowed = torch.full((self.nodes(method, budget), grammar.words(self.vocab)), -1, dtype=torch.int32,
                                     device=self.device)
            steps: list[tuple[str, Callable]] = []
            if method == "ar":
                steps.append(("tree", lambda _: self.lone_root()))
            else:
                steps.append(("draft", lambda _: self.draft_logits()))
                # draft-logit columns -> token ids (None: the same); a DFlash2 drafter's tree is over its selector's
                steps.append(("tree", self.fused_draft.tree_step(method, budget, self.draft_head.token_ids)))
            depth = 0 if method == "ar" else self.block - 1
            steps.append(("verify", lambda tree: self.verify(*tree, max_depth=depth, noise=noise, filters=filters,
                                                             allowed=allowed, adjusted=adjusted, logprobs=logprobs)))
            steps.append(("commit", lambda out: self.commit(*out[1:5], with_draft=method != "ar", recurrent=out[6])))
            cuda = self.device.type == "cuda"
            self._plans[key] = Plan(steps, self._capture if cuda else None, cuda, noise, allowed)
        return self._plans[key]

    def _capture(self, fn: Callable, arg: object, pool: tuple | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm up, capture (into memory `pool` when given: graphs that never run at once), replay once. Runs
        move `start`, so it is reset after each; the captures happen before a prefill, which rewrites every row
        that a later round reads."""
        self._warm_up(fn, arg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(arg)
        graph.replay()  # a capture runs nothing: the next step's warm-ups must read real outputs, not fresh memory
        self.start.zero_()
        return graph, out

    def _warm_up(self, fn: Callable, arg: object) -> None:
        """Run a step twice on a side stream before its capture (first calls compile, probe and allocate),
        resetting `start` after each."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(arg)
                self.start.zero_()
        torch.cuda.current_stream().wait_stream(stream)

    # -- the steps --------------------------------------------------------------------------------------

    @for_fp8_targets
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                last_only: bool = False, last_row: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        """Target rows ids [N] at positions [N], written to cache slots start.. start+N-1.

        visible [N, N] says which of the new rows each row sees (the tree's ancestors, or causal); every
        row also sees the committed rows 0 .. start-1. Returns (logits [N, V], or [1, V] of the last row with
        `last_only` or of row `last_row` [1] (a padded prompt's last real one), taps [N, k*H], what the
        commit of recurrent layers needs: None here, as attention layers keep everything in the K/V cache).
        A layer's residual add is deferred into the next layer's norm, so a tapped layer's output is the
        residual that the next norm (or the final norm) returns.
        """
        n, ops, eps = ids.numel(), self.ops, self.eps
        mask = tree_mask(self.start, visible, self.capacity, self.heads // self.kv_heads, self.head_dim, self.dtype)
        slots = self.start + self.steps[:n]
        x = embed(self.model.embed_tokens, ids)
        cos, sin = self.target_rope(positions)
        tapped: dict[int, torch.Tensor] = {}
        delta = None
        one_row = n == 1 and self.row_gemv
        step = decoder_row if one_row else decoder_layer
        for i, layer in enumerate(self.layers):  # layer i hands back layer i-1's output (-1: the embeddings)
            tapped[i - 1], x, delta = step(ops, layer, x, delta, self.kv[i], mask, slots, cos, sin, eps)
        norm = self.model.norm
        if one_row and last_row is None:
            logits, x = gemv(x, self.target.lm_head.weight, NORM, delta, norm.weight, norm.variance_epsilon)
        else:
            h, x = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
            rows = h.index_select(0, last_row) if last_row is not None else h[-1:] if last_only else h
            logits = linear(rows, self.target.lm_head.weight, self.target.lm_head.bias)
        tapped[len(self.layers) - 1] = x
        taps = torch.cat([tapped[t] for t in self.taps], dim=-1) if self.taps else None
        return logits, taps, None

    @prompt_rows()
    def prefill(self, prompt: torch.Tensor, with_draft: bool, noise: torch.Tensor | None = None,
                filters: Filters | None = None, allowed: torch.Tensor | None = None, adjusted: bool = False,
                logprobs: bool = False, every_row: bool = False, pooled: PooledPrompt | None = None,
                ) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """Fill the caches with the prompt (CUDA graphs by bucket of rows where they fit, else eagerly); returns the
        first token (sampled with `noise` [1, V] and `filters`, and restricted to the packed mask `allowed`
        [1, words], when given), with `logprobs` its `token_logprobs` (the 20 best alternatives), and with
        `every_row` the raw logits of every prompt row computed [n, V] (for prompt logprobs). `pooled`: the
        prompt's cached prefix is read from the pool, and the rows computed here are written there."""
        n = prompt.numel()
        cached = pooled.cached if pooled is not None else 0
        if self.prompt_graphs is not None and not every_row and self.prompt_graphs.fits(cached, n - cached):
            self.prompt_graphs.capture()  # before the pool's rows are read: a capture writes cache rows
            if cached:
                self._read_pool(pooled)
            prompt_logits = self.prompt_graphs.run(prompt[cached:], cached)  # the drafter's context too
        else:
            if cached:
                self._read_pool(pooled)
            self.start.fill_(cached)
            positions = torch.arange(cached, n, device=self.device)
            causal = torch.ones(n - cached, n - cached, dtype=torch.bool, device=self.device).tril()
            prompt_logits, taps = self.prompt_forward(prompt[cached:], positions, causal, every_row)
            if with_draft:
                self._extend_draft(taps, positions)
        logits = self.before_pick(prompt_logits[-1:], allowed, adjusted)
        processed = self.processed(logits, noise is not None, filters)
        root = self.pick(processed, noise)[0]
        if adjusted:
            self.emitted_counts[root] += 1
        if pooled is not None:
            self._write_pool(pooled, n, with_draft)
        self.start.fill_(n)
        self.root.copy_(root)
        root_logprobs = self._token_logprobs(processed, root.view(1)) if logprobs else None
        return int(root), root_logprobs, prompt_logits if every_row else None

    def _read_pool(self, pooled: PooledPrompt) -> None:
        """The cached prefix's target and drafter K/V, from the pool's pages into rows 0 .. cached - 1."""
        copy_pages(pooled.kv, self.kv, pooled.pages, pooled.page)
        if self.draft is not None:
            copy_pages(pooled.draft_kv, self.draft_kv, pooled.pages, pooled.page)

    def _write_pool(self, pooled: PooledPrompt, n: int, with_draft: bool) -> None:
        """The prompt rows this prefill computed (cached .. n - 1) into their pool slots."""
        pooled.kv.index_copy_(3, pooled.slots, self.kv[:, :, :, pooled.cached:n])
        if with_draft:
            pooled.draft_kv.index_copy_(3, pooled.slots, self.draft_kv[:, :, :, pooled.cached:n])

    def prompt_forward(self, prompt: torch.Tensor, positions: torch.Tensor, causal: torch.Tensor,
                       every_row: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt's forward after the `start` rows cached: (the last row's logits [1, V], or with `every_row`
        every row's [n, V]; taps of every row)."""
        logits, taps, _ = self.forward(prompt, positions, causal, last_only=not every_row)
        return logits, taps

    def lone_root(self) -> tuple[torch.Tensor, ...]:
        """The AR "tree": the root alone."""
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        return zero[:0], zero, zero, torch.ones(1, 1, dtype=torch.bool, device=self.device)

    def draft_logits(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The drafter's block pass: [root, mask x D] at start.. over the static context cache -> logits [D, V] over
        the draft head's tokens (a DFlash2 drafter: its selector's transition model, fast/dflash2.py). Each layer
        sees the block rows its causality rule shows (fast/layers.py `Draft.masks`)."""
        dc, fused, ops = self.draft.config, self.fused_draft, self.ops
        x = fused.embed(embed(self.target.embed_tokens, self.draft_block))
        slots = self.start + self.steps[:self.block]
        cos, sin = self.draft_rope(slots)
        masks = fused.masks(self.start, self.capacity, self.dtype)
        step = fused.layer_step or decoder_layer
        delta = None
        for i, layer in enumerate(fused.layers):
            _, x, delta = step(ops, layer, x, delta, self.draft_kv[i], masks[i], slots, cos, sin, dc.rms_norm_eps)
        return fused.propose(ops, x[1:], delta[1:], self.draft_head, self.root)

    def verify(self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor,
               max_depth: int, noise: torch.Tensor | None = None, filters: Filters | None = None,
               allowed: torch.Tensor | None = None, adjusted: bool = False,
               logprobs: bool = False) -> tuple[torch.Tensor | None, ...]:
        """One target forward over root + tree (`visible`: each node and its ancestors), then the walk, on
        the device.

        Every node gets the target's own pick (argmax, or an independent sample when `noise` is given);
        node i is accepted when the pick at every ancestor-or-self edge matches (siblings hold distinct
        tokens, so the accepted nodes form one root path). The emitted tokens are the picks along that
        path, so a sampled round emits exactly what sampling the target token by token would. Returns
        (result = [accepted length, emitted tokens..., padding], path nodes [D+1], accepted length, bonus
        token, taps, the path nodes' `token_logprobs` (with `logprobs`), what the commit of recurrent layers
        needs). The packed masks `allowed` [n, words] restrict each node's pick (a grammar: before any
        other processing).
        """
        ids = torch.cat([self.root.view(1), tokens])
        logits, taps, recurrent = self.forward(ids, self.start + depths, visible)
        logits = self.before_pick(logits, allowed, adjusted, ids, visible)
        processed = self.processed(logits, noise is not None, filters)
        picks = self.pick(processed, noise)
        result, path, length, bonus = accept(ids, picks, parents, depths, visible, max_depth)
        emitted = result[1:]
        if adjusted:  # what this round emits, for the penalties of the next
            valid = torch.arange(max_depth + 1, device=self.device) < length
            self.emitted_counts.index_add_(0, emitted, valid.float())
        rows = self._token_logprobs(processed.index_select(0, path), emitted) if logprobs else None
        return result, path, length, bonus, taps, rows, recurrent

    def before_pick(self, logits: torch.Tensor, allowed: torch.Tensor | None, adjusted: bool,
                    ids: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Raw logits with the grammar's masks (`allowed`), then the bias and penalties when `adjusted`: the
        reference path's order."""
        logits = grammar.mask_logits(logits, allowed)
        return self.adjust(logits, ids, visible) if adjusted else logits

    def adjust(self, logits: torch.Tensor, ids: torch.Tensor | None = None,
               visible: torch.Tensor | None = None) -> torch.Tensor:
        """Raw logits [n, V] with the request's logit bias and penalties, as the reference path's
        `process_logits` applies them: each row sees the emitted tokens plus its own path below the root
        (the tokens of `ids` that `visible` [n, n] marks, the root itself excluded). Float32."""
        out = logits.float() + self.bias
        counts = self.emitted_counts.expand(out.shape[0], -1)
        if visible is not None and out.shape[0] > 1:
            n = out.shape[0]
            below_root = visible & (torch.arange(n, device=self.device) > 0)[None, :]
            rows = torch.arange(n * n, device=self.device) // n  # (row i, column j) pairs, row-major
            counts = counts.clone()
            counts.view(-1).index_add_(0, rows * counts.shape[1] + ids.repeat(n), below_root.flatten().float())
        repetition, frequency, presence = self.penalties
        return apply_penalties(out, counts, self.prompt_seen | (counts > 0), repetition, frequency, presence)

    def _load_adjustments(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        """A generation's logit bias and penalties into the buffers its plans read; nothing emitted yet."""
        self.bias.zero_()
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias[list(ids)] = torch.tensor(values, device=self.device)
        self.penalties.copy_(torch.tensor([params.repetition_penalty, params.frequency_penalty,
                                           params.presence_penalty]))
        self.emitted_counts.zero_()
        self.prompt_seen.zero_()
        self.prompt_seen[torch.tensor(prompt_ids, device=self.device)] = True

    def processed(self, logits: torch.Tensor, sampled: bool, filters: Filters | None) -> torch.Tensor:
        """Rows as the reference's `process_logits` leaves them, what both the picks and the logprobs read:
        temperature-scaled and filtered (float32) when sampled, else as they are; `logits` already carry the
        grammar mask, bias and penalties."""
        if not sampled:
            return logits
        out = logits.float() * self.inv_temperature
        return filter_logits(out, *filters) if filters is not None else out

    def _token_logprobs(self, processed: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_logprobs` with as many alternatives as any request may ask for (each takes its own share)."""
        return token_logprobs(processed, tokens, min(MAX_TOP_LOGPROBS, self.vocab))

    def pick(self, processed: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Per row of `processed` rows: the argmax, or with uniform noise [N, V] a sample of their softmax
        (Gumbel-max: tokens the filters set to -inf stay there).

        A noise value of exactly 0 gives that token -inf (never picked), not +inf: the safe side.
        """
        if noise is None:
            return vocab_argmax(processed)
        return vocab_argmax(processed - torch.log(-torch.log(noise)))

    def commit(self, path: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor, taps: torch.Tensor | None,
               with_draft: bool, recurrent: object = None) -> None:
        """Keep the path's rows (copied down to start..), extend the draft context, advance start and root
        (`recurrent`: what a hybrid target's verify left for its recurrent layers; see fast/hybrid.py).

        Rows past the accepted length are copied too (fixed shapes) but lie beyond `start` afterwards, where
        every mask hides them until they are overwritten.
        """
        rows = path.numel()
        if rows > 1:
            compact(self.kv, self.start, path)
        if with_draft:
            self._extend_draft(gather_rows(taps, path), self.start + self.steps[:rows])
        self.start += length
        self.root.copy_(bonus)

    def prompt_chunk(self, ids: torch.Tensor, positions: torch.Tensor, causal: torch.Tensor,
                     last: torch.Tensor) -> torch.Tensor:
        """A padded prompt chunk (fast/prompt.py): the target's logits of row `last`, the drafter's context."""
        logits, taps, _ = self.forward(ids, positions, causal, last_row=last)
        if self.draft is not None:
            self._extend_draft(taps, positions)
        return logits

    def _extend_draft(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Context K/V of committed rows (tap features at their positions) into the draft cache rows = positions."""
        kv = self.fused_draft.context(self.ops, self.draft, feats, *self.draft_rope(positions))
        self.draft_kv.index_copy_(3, positions, kv)


def _adjusted(params: SamplingParams) -> bool:
    """Whether a request's logits get a bias or penalties before its picks (an adjusted plan)."""
    return params.penalized or bool(params.logit_bias)
