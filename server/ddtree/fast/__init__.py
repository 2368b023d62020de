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

Scope: greedy requests without logprobs, on dense pure-attention Qwen3 / Llama-family targets (no sliding
windows, no MoE, no hybrid recurrent layers). Everything else stays on the reference path.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from ddtree.draft import DFlashDraft
from ddtree.target import HybridTarget, Target

if TYPE_CHECKING:
    from ddtree.engine import Generation, RoundOutput

ARCHITECTURES = ("qwen3", "llama")


def unsupported(target: Target) -> str | None:
    """Why the fast path cannot run this target (None when it can)."""
    cfg = target.config
    if isinstance(target, HybridTarget):
        return "hybrid (recurrent) targets use the reference path"
    if cfg.model_type not in ARCHITECTURES:
        return f"model type {cfg.model_type} is not one of {', '.join(ARCHITECTURES)}"
    if set(target.layer_types) != {"full_attention"}:
        return "sliding-window layers use the reference path"
    if not all(hasattr(layer.mlp, "gate_proj") for layer in target.layers):
        return "only dense MLPs are supported"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if any(abs(layer.self_attn.scaling - head_dim**-0.5) > 1e-9 for layer in target.layers):
        return "attention scaling other than 1/sqrt(head_dim)"
    return None


def top_prefixes(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """The `budget` most probable prefixes of the per-depth product distribution, as tensors on the device.

    Same set as tree.build_tree (barring exact score ties), built without the host: per depth, the best
    `budget` prefixes can only extend the best `budget` of the depth above, so D static top-k's over
    [budget x K] candidates find them; one stable sort by score (shallower first on ties) then numbers the
    nodes best-first, so every parent precedes its children. Returns (tokens [N-1], parents [N], depths [N]),
    N = nodes + 1 with the root at 0 (parent 0, depth 0).
    """
    logits = draft_logits.float()
    max_depth, vocab = logits.shape
    k = min(budget, vocab)
    top, tok = logits.topk(k, dim=-1)  # fused top-k: log-probs are the top logits minus the log-partition
    logp = top - logits.logsumexp(dim=-1, keepdim=True)
    scores, parents, tokens, depths = [logp[0]], [torch.full((k,), -1, device=logits.device)], [tok[0]], [1]
    offset = 0
    for d in range(1, max_depth):
        prev = scores[-1]
        cand = (prev[:, None] + logp[d][None, :]).flatten()
        s, idx = cand.topk(min(budget, cand.numel()))
        parents.append(idx // k + offset)
        tokens.append(tok[d][idx % k])
        scores.append(s)
        depths.append(d + 1)
        offset += prev.numel()
    score = torch.cat(scores)
    depth = torch.cat([torch.full_like(s, d, dtype=torch.long) for s, d in zip(scores, depths, strict=True)])
    order = torch.sort(score, descending=True, stable=True).indices[:budget]
    node_of = torch.zeros(score.numel(), dtype=torch.long, device=logits.device)
    node_of[order] = torch.arange(1, order.numel() + 1, device=logits.device)
    parent_cand = torch.cat(parents)[order]
    root = torch.zeros(1, dtype=torch.long, device=logits.device)
    node_parents = torch.cat([root, torch.where(parent_cand >= 0, node_of[parent_cand.clamp(min=0)], 0)])
    return torch.cat(tokens)[order], node_parents, torch.cat([root, depth[order]])


def chain(draft_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Linear DFlash on the device: the argmax token at every depth, each node the child of the one before."""
    n = draft_logits.shape[0] + 1
    steps = torch.arange(n, device=draft_logits.device)
    return draft_logits.argmax(dim=-1), (steps - 1).clamp(min=0), steps


def ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """bool [N, N]: row i holds i and its ancestors (transitive closure of the parent edge by squaring)."""
    n = parents.numel()
    reach = torch.eye(n, device=parents.device)
    reach.scatter_(1, parents[:, None], torch.ones(n, 1, device=parents.device))  # no host scalar: capturable
    for _ in range(max(max_depth, 1).bit_length()):
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0


class FastPath:
    """Static caches and per-(method, budget) step graphs for one target (+ draft); one generation at a time."""

    def __init__(self, target: Target, draft: DFlashDraft | None, capacity: int = 4096) -> None:
        cfg = target.config
        self.target, self.draft = target, draft
        self.model = target.model.model
        self.device, self.dtype = target.device, target.dtype
        self.capacity = -(-min(capacity, target.max_context) // 64) * 64  # aligned rows for the attention kernels
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        shape = (len(target.layers), self.kv_heads, self.capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.columns = torch.arange(self.capacity, device=self.device)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # tokens committed to the caches
        self.root = torch.zeros((), dtype=torch.long, device=self.device)  # last committed token, not cached yet
        self.taps: tuple[int, ...] = draft.config.target_layer_ids if draft is not None else ()
        if draft is not None:
            dc = draft.config
            self.block = dc.block_size
            dshape = (dc.num_layers, dc.num_kv_heads, self.capacity + self.block, dc.head_dim)
            self.draft_keys = torch.zeros(dshape, dtype=self.dtype, device=self.device)
            self.draft_values = torch.zeros_like(self.draft_keys)
        self._plans: dict[tuple[str, int], Plan] = {}
        self._busy = False

    # -- which requests ---------------------------------------------------------------------------------

    def nodes(self, method: str, budget: int) -> int:
        """Rows one verify pass takes (root included)."""
        if method == "ar":
            return 1
        depth = self.block - 1
        if method == "dflash":
            return depth + 1
        vocab = self.target.shape.vocab_size
        k = min(budget, vocab)
        candidates = sum(min(budget, k**d) for d in range(1, depth + 1))
        return min(budget, candidates) + 1

    def accepts(self, gen: Generation) -> bool:
        """Greedy, no logprobs, a nonzero budget, and the whole request fits the static caches."""
        p = gen.params
        if self._busy or not p.greedy or p.logprobs is not None or (gen.method != "ar" and self.draft is None):
            return False
        if gen.method == "ddtree" and gen.budget < 1:
            return False
        depth = 0 if gen.method == "ar" else self.block - 1
        rows = len(gen.prompt_ids) + p.max_new_tokens + self.nodes(gen.method, gen.budget) + depth + 1
        return rows <= self.capacity and rows < gen.engine.max_context

    # -- the decoding loop ------------------------------------------------------------------------------

    @torch.inference_mode()
    def rounds(self, gen: Generation) -> Iterator[RoundOutput]:
        """Generation._run on the fast path: same RoundOutputs, same stats, same tokens."""
        self._busy = True
        try:
            plan = self.plan(gen.method, gen.budget)  # captured before the prefill resets the state
            t0 = time.perf_counter()
            root = self.prefill(torch.tensor(gen.prompt_ids, device=self.device), with_draft=gen.method != "ar")
            gen.stats.prefill_seconds = self._sync() - t0
            yield gen._emit([root], None, [], 0, 0, {"prefill": gen.stats.prefill_seconds}, True)
            decode_start = time.perf_counter()
            while gen.finish_reason is None:
                t = time.perf_counter()
                result, phases = plan.run()
                n = result[0]
                emitted = result[1:1 + n]
                phases["host"] = max(time.perf_counter() - t - sum(phases.values()), 0.0)
                out = gen._emit(emitted, None, [], self.nodes(gen.method, gen.budget) - 1, n - 1, phases, False)
                gen.stats.rounds += 1
                gen.stats.committed_tokens += n
                for d in range(n - 1):
                    gen.stats.accepted_per_depth[d] += 1
                for name, seconds in phases.items():
                    gen.stats.phase_seconds[name] = gen.stats.phase_seconds.get(name, 0.0) + seconds
                gen.stats.decode_seconds = time.perf_counter() - decode_start
                yield out
        finally:
            self._busy = False

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def plan(self, method: str, budget: int) -> Plan:
        """The round's steps for (method, budget), captured as CUDA graphs on first use."""
        key = (method, budget if method == "ddtree" else 0)
        if key not in self._plans:
            steps: list[tuple[str, Callable]] = []
            if method == "ar":
                steps.append(("tree", lambda _: self.lone_root()))
            else:
                steps.append(("draft", lambda _: self.draft_logits()))
                steps.append(("tree", (lambda x: top_prefixes(x, budget)) if method == "ddtree" else chain))
            depth = 0 if method == "ar" else self.block - 1
            steps.append(("verify", lambda tree: self.verify(*tree, max_depth=depth)))
            steps.append(("commit", lambda out: self.commit(*out[1:], with_draft=method != "ar")))
            cuda = self.device.type == "cuda"
            self._plans[key] = Plan(steps, self._capture if cuda else None, cuda)
        return self._plans[key]

    def _capture(self, fn: Callable, arg: object) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm up on a side stream, then capture. Warm-ups move `start`, so it is reset after each run;
        the captures happen before a prefill, which rewrites every row that a later round reads."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(arg)
                self.start.zero_()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(arg)
        self.start.zero_()
        return graph, out

    # -- the steps --------------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target rows ids [N] at positions [N], written to cache slots start.. start+N-1.

        visible [N, N] says which of the new rows each row sees (the tree's ancestors, or causal); every
        row also sees the committed rows 0 .. start-1. Returns (logits [N or 1, V], taps [N, k*H]).
        """
        n = ids.numel()
        groups = self.heads // self.kv_heads
        rel = self.columns - self.start
        new = visible.index_select(1, rel.clamp(0, n - 1)) & (rel >= 0) & (rel < n)
        allowed = (rel < 0) | new
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(self.dtype).min).repeat(groups, 1)[None, None]
        slots = self.start + torch.arange(n, device=self.device)
        x = self.model.embed_tokens(ids)[None]
        cos, sin = self.model.rotary_emb(x, positions[None])
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, self.heads, self.head_dim)
            k = attn.k_proj(h).view(1, n, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            self.keys[i].index_copy_(1, slots, k[0])
            self.values[i].index_copy_(1, slots, v[0])
            x = x + attn.o_proj(_grouped_attention(q, self.keys[i], self.values[i], mask, self.kv_heads))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.taps:
                tapped[i] = x[0]
        if last_only:
            x = x[:, -1:]
        logits = self.target.lm_head(self.model.norm(x))[0]
        taps = torch.cat([tapped[t] for t in self.taps], dim=-1) if self.taps else None
        return logits, taps

    def prefill(self, prompt: torch.Tensor, with_draft: bool) -> int:
        """Fill the caches with the prompt (eager: its length varies); returns the first token."""
        n = prompt.numel()
        self.start.zero_()
        positions = torch.arange(n, device=self.device)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        logits, taps = self.forward(prompt, positions, causal, last_only=True)
        root = logits[-1].argmax()
        if with_draft:
            self._extend_draft(taps, positions)
        self.start.fill_(n)
        self.root.copy_(root)
        return int(root)

    def lone_root(self) -> tuple[torch.Tensor, ...]:
        """The AR "tree": the root alone."""
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        return zero[:0], zero, zero

    def draft_logits(self) -> torch.Tensor:
        """The DFlash block pass: [root, mask x D] at start.. over the static context cache -> logits [D, V]."""
        draft, dc = self.draft, self.draft.config
        q_len, cap = self.block, self.capacity
        block = torch.full((q_len,), dc.mask_token_id, device=self.device)
        block[0] = self.root
        x = self.target.embed_tokens(block)[None]
        positions = self.start + torch.arange(q_len, device=self.device)
        cos, sin = draft.rotary(x, positions[None])
        key_pos = torch.cat([self.columns, positions])
        valid = torch.cat([self.columns < self.start, torch.ones(q_len, dtype=torch.bool, device=self.device)])
        masks = {}
        for window in set(dc.layer_windows):
            allowed = valid[None, :].expand(q_len, -1)
            if window is not None:
                allowed = allowed & (positions[:, None] - key_pos[None, :] < window)
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            masks[window] = mask.masked_fill_(~allowed, torch.finfo(self.dtype).min).repeat(
                dc.num_heads // dc.num_kv_heads, 1)[None, None]
        for i, layer in enumerate(draft.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(1, q_len, dc.num_heads, dc.head_dim)).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            k, v = attn.project_kv(h, cos, sin)
            self.draft_keys[i, :, cap:] = k[0]
            self.draft_values[i, :, cap:] = v[0]
            out = _grouped_attention(q, self.draft_keys[i], self.draft_values[i], masks[dc.layer_windows[i]],
                                     dc.num_kv_heads)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.target.lm_head(draft.norm(x)[0, 1:])

    def verify(self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
               max_depth: int) -> tuple[torch.Tensor, ...]:
        """One target forward over root + tree, then the greedy walk, on the device.

        Node i is accepted when the target's pick at every ancestor-or-self edge matches (siblings hold
        distinct tokens, so the accepted nodes form one root path). Returns (result = [accepted length,
        emitted tokens..., padding], path nodes [D+1], accepted length, bonus token, taps).
        """
        n = parents.numel()
        ids = torch.cat([self.root.view(1), tokens])
        visible = ancestors(parents, max_depth)
        logits, taps = self.forward(ids, self.start + depths, visible)
        picks = logits.argmax(dim=-1)
        steps = torch.arange(n, device=self.device)
        matches = (ids == picks[parents]) | (steps == 0)
        accepted = ~(visible & ~matches[None, :]).any(dim=1)
        length = accepted.sum()
        slot = torch.where(accepted, depths, max_depth + 1)
        path = torch.zeros(max_depth + 2, dtype=torch.long, device=self.device).scatter_(0, slot, steps)
        path = path[:max_depth + 1]
        emitted = picks[path]
        bonus = emitted.gather(0, (length - 1).view(1))[0]
        result = torch.cat([length.view(1), emitted])
        return result, path, length, bonus, taps

    def commit(self, path: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor, taps: torch.Tensor | None,
               with_draft: bool) -> None:
        """Keep the path's rows (copied down to start..), extend the draft context, advance start and root.

        Rows past the accepted length are copied too (fixed shapes) but lie beyond `start` afterwards, where
        every mask hides them until they are overwritten.
        """
        rows = path.numel()
        if rows > 1:
            src = self.start + path
            dst = self.start + torch.arange(rows, device=self.device)
            self.keys.index_copy_(2, dst, self.keys.index_select(2, src))
            self.values.index_copy_(2, dst, self.values.index_select(2, src))
        if with_draft:
            self._extend_draft(taps.index_select(0, path), self.start + torch.arange(rows, device=self.device))
        self.start += length
        self.root.copy_(bonus)

    def _extend_draft(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Context K/V of committed rows (tap features at their positions) into the draft cache rows = positions."""
        for i, (k, v) in enumerate(self.draft.context_kv(feats[None], positions[None], self.dtype)):
            self.draft_keys[i].index_copy_(1, positions, k[0])
            self.draft_values[i].index_copy_(1, positions, v[0])


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       kv_heads: int) -> torch.Tensor:
    """SDPA of q [1, H, N, d] over one layer's cache [kv, T, d] -> [1, N, H*d], without repeating K/V.

    The query heads that share a K/V head are stacked along the query axis ([1, kv, groups*N, d]), so
    every kernel reads each cached row once; the mask was repeated per group to match.
    """
    _, heads, n, d = q.shape
    out = F.scaled_dot_product_attention(q.reshape(1, kv_heads, heads // kv_heads * n, d), keys[None],
                                         values[None], attn_mask=mask)
    return out.view(1, heads, n, d).transpose(1, 2).reshape(1, n, heads * d)


class Plan:
    """One (method, budget)'s round: its steps, replayed from their CUDA graphs when captured, else run eagerly.

    A capture that fails (an op that cannot be captured on this torch build) leaves the whole plan eager,
    on the same static buffers, with the reason in `eager_reason`: slower, never wrong.
    """

    def __init__(self, steps: list[tuple[str, Callable]], capture: Callable | None, cuda: bool) -> None:
        self.steps, self.cuda = steps, cuda
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.result: torch.Tensor | None = None
        self.eager_reason = None if capture is not None else "graphs off"
        if capture is not None:
            out = None
            try:
                for name, fn in steps:
                    graph, out = capture(fn, out)
                    self.graphs.append(graph)
                    if name == "verify":
                        self.result = out[0]
            except RuntimeError as exc:
                self.graphs, self.eager_reason = [], f"capture failed: {str(exc).splitlines()[0]}"
                print(f"ddtree fast path: {self.eager_reason}; running eagerly", file=sys.stderr)

    def run(self) -> tuple[list[int], dict[str, float]]:
        """One round; returns ([accepted length, emitted tokens...], seconds per step)."""
        stamps: list = []
        out = result = None
        for i, (name, fn) in enumerate(self.steps):
            stamps.append(_stamp(self.cuda))
            if self.graphs:
                self.graphs[i].replay()
            else:
                out = fn(out)
                result = out[0] if name == "verify" else result
        stamps.append(_stamp(self.cuda))
        values = (self.result if self.graphs else result).tolist()  # the round's one synchronisation
        spans = zip(self.steps, stamps[:-1], stamps[1:], strict=True)
        return values, {name: _elapsed(a, b) for (name, _), a, b in spans}


def _stamp(cuda: bool) -> torch.cuda.Event | float:
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(a: torch.cuda.Event | float, b: torch.cuda.Event | float) -> float:
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3
