"""DDTree over a first-order transition model (DFlash2's selector) on the device: static shapes, no host sync.

The same trees as core/tree.py's `build_selector_tree` (barring exact score ties), as tensors a CUDA graph can
replay, and the selector's chain. The model is each depth's k candidates with, per row i (the previous depth's
candidate i; the root's row at depth 1), the log-probabilities of the k successors sorted best first
(`logp` [D, k, k]), which candidate each rank is (`order` [D, k, k]), and the candidates' tokens [D, k].
"""

from __future__ import annotations

import torch

from ddtree.kernels.jit import attempt, triton_works
from ddtree.kernels.tree import _pow2, _tree_warps, ancestors, tree_size

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch loop below
    triton = None


def selector_prefixes(logp: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor,
                      budget: int) -> tuple[torch.Tensor, ...]:
    """The `budget` most probable prefixes of the transition model, as (tokens [N-1], parents [N], depths [N],
    visible [N, N] bool), N = nodes + 1 with the root at 0 (kernels/tree.py's `top_prefixes` layout).

    As there, every depth keeps `budget` slots sorted best first (unused ones score -inf), as the best prefixes
    of depth d can only extend the best of depth d-1. A slot also carries its candidate (its state): its
    children's scores are its own row of the next depth's transitions. The j-th best child of slot i is in the
    best `budget` only if slots 0..i and that slot's children 0..j are too, so i + j < budget: the "frontier"
    pairs one selection per depth takes (the marginal model's (i+1)(j+1) <= budget does not hold here, where
    each slot has its own row). One stable ordering by score (shallower first on ties) numbers the nodes."""
    max_depth, width = tokens.shape
    k = min(budget, width)
    device = tokens.device
    pairs = _frontier(budget, k, device)
    n = tree_size(max_depth, k, budget)
    if triton_works(device):
        built = attempt(("selector tree", max_depth, k, budget, device), _build_on_gpu, logp, order, tokens, pairs,
                        budget, n)
        if built is not None:
            return built
    scores = logp.new_full((max_depth, budget), float("-inf"))
    states = torch.zeros((max_depth, budget), dtype=torch.long, device=device)
    parent_slot = torch.zeros((max_depth, budget), dtype=torch.long, device=device)
    scores[0, :k], states[0, :k] = logp[0, 0, :k], order[0, 0, :k]
    slot, rank = pairs.div(k, rounding_mode="floor"), pairs.remainder(k)
    for d in range(1, max_depth):
        before = states[d - 1, slot]
        cand = scores[d - 1, slot] + logp[d, before, rank]
        best, picked = cand.sort(descending=True, stable=True)
        picked = picked[:budget]
        scores[d], parent_slot[d] = best[:budget], slot[picked]
        states[d] = order[d, before[picked], rank[picked]]
    depth = torch.arange(max_depth, device=device)[:, None]
    node_tokens = tokens.gather(1, states)
    numbered = torch.sort(scores.flatten(), descending=True, stable=True).indices[:n]
    node_of = torch.zeros(max_depth * budget, dtype=torch.long, device=device)
    node_of[numbered] = torch.arange(1, n + 1, device=device)
    parent = torch.where(depth > 0, (depth - 1) * budget + parent_slot, -1).flatten()[numbered]
    root = torch.zeros(1, dtype=torch.long, device=device)
    parents = torch.cat([root, torch.where(parent >= 0, node_of[parent.clamp(min=0)], 0)])
    return (node_tokens.flatten()[numbered], parents,
            torch.cat([root, numbered.div(budget, rounding_mode="floor") + 1]), ancestors(parents, max_depth))


def selector_chain(logp: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The selector's chain (each depth's best candidate after the previous pick, the root first) in the layout of
    kernels/tree.py's `chain`: (tokens [D], parents, depths, visible)."""
    max_depth = tokens.shape[0]
    device = tokens.device
    chosen = None
    if triton_works(device):
        chosen = attempt(("selector chain", max_depth, tokens.shape[1], device), _chain_on_gpu, order, tokens)
    if chosen is None:
        state = torch.zeros((), dtype=torch.long, device=device)
        picks = []
        for d in range(max_depth):
            state = order[d, state, 0]
            picks.append(tokens[d, state])
        chosen = torch.stack(picks)
    steps = torch.arange(max_depth + 1, device=device)
    causal = torch.ones(max_depth + 1, max_depth + 1, dtype=torch.bool, device=device).tril()
    return chosen, (steps - 1).clamp(min=0), steps, causal


_FRONTIERS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _frontier(budget: int, k: int, device: torch.device) -> torch.Tensor:
    """Flat indices i * k + j of the (slot i, rank j) pairs with i + j < budget, i-major: at least `budget` of
    them, so a depth's selection never runs short. Cached per device (made at the warm-up, not in a capture)."""
    key = (budget, k, device)
    if key not in _FRONTIERS:
        pairs = [i * k + j for i in range(budget) for j in range(k) if i + j < budget]
        _FRONTIERS[key] = torch.tensor(pairs, device=device)
    return _FRONTIERS[key]


def _build_on_gpu(logp: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor, pairs: torch.Tensor, budget: int,
                  n: int) -> tuple[torch.Tensor, ...]:
    """selector_prefixes in one Triton program: the per-depth selections, the numbering, the parents and the
    ancestor matrix (a launch costs more than a depth's work)."""
    max_depth, width = tokens.shape
    k = min(budget, width)
    device = tokens.device
    logp, order, tokens = logp.float().contiguous(), order.contiguous(), tokens.contiguous()
    scores = torch.empty((max_depth, budget), dtype=torch.float32, device=device)
    states = torch.empty((max_depth, budget), dtype=torch.int64, device=device)
    parent_slot = torch.empty((max_depth, budget), dtype=torch.int64, device=device)
    node_of = torch.empty(max_depth * budget, dtype=torch.int64, device=device)
    node_tokens = torch.empty(n, dtype=torch.int64, device=device)
    parents = torch.empty(n + 1, dtype=torch.int64, device=device)
    depths = torch.empty(n + 1, dtype=torch.int64, device=device)
    visible = torch.zeros((n + 1, n + 1), dtype=torch.uint8, device=device)
    _selector_tree_kernel[(1,)](logp, order, tokens, pairs, scores, states, parent_slot, node_of, node_tokens, parents,
                                depths, visible, pairs.numel(), width, k, budget, n, MAX_DEPTH=max_depth,
                                SPAN=_pow2(pairs.numel()), BUDGET=_pow2(budget), EVERY=_pow2(max_depth * budget),
                                NODES=_pow2(n), ROWS=_pow2(n + 1), num_warps=_tree_warps(budget))
    return node_tokens, parents, depths, visible.view(torch.bool)


def _chain_on_gpu(order: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    max_depth, width = tokens.shape
    chosen = torch.empty(max_depth, dtype=torch.int64, device=tokens.device)
    _selector_chain_kernel[(1,)](order.contiguous(), tokens.contiguous(), chosen, width, MAX_DEPTH=max_depth,
                                 num_warps=1)
    return chosen


if triton is not None:
    # The tree kernel's jit helpers, which exist only where Triton does.
    from ddtree.kernels.tree import _ancestor_matrix, _key, _key_score, _number_best_first

    @triton.jit
    def _selector_tree_kernel(Logp, Order, Tok, Pairs, Scores, States, ParentSlot, NodeOf, Tokens, Parents, Depths,
                              Visible, num_pairs, width, k, budget, n, MAX_DEPTH: tl.constexpr, SPAN: tl.constexpr,
                              BUDGET: tl.constexpr, EVERY: tl.constexpr, NODES: tl.constexpr, ROWS: tl.constexpr):
        """The PyTorch path of selector_prefixes, step for step (selection keys as in kernels/tree.py)."""
        lowest = -9223372036854775807
        b = tl.arange(0, BUDGET)
        keep = b < budget
        first = b < k
        state = tl.load(Order + b, mask=first, other=0)  # depth 1: the root's row
        tl.store(Scores + b, tl.load(Logp + b, mask=first, other=float("-inf")), mask=keep)
        tl.store(States + b, state, mask=keep)
        tl.store(ParentSlot + b, tl.zeros_like(state), mask=keep)
        f = tl.arange(0, SPAN)
        valid = f < num_pairs
        pair = tl.load(Pairs + f, mask=valid, other=0)
        slot, rank = pair // k, pair % k
        tl.debug_barrier()
        for d in range(1, MAX_DEPTH):  # the best `budget` frontier extensions of depth d-1's slots
            before = tl.load(States + (d - 1) * budget + slot, mask=valid, other=0)
            cand = tl.load(Scores + (d - 1) * budget + slot, mask=valid, other=float("-inf"))
            cand += tl.load(Logp + (d * width + before) * width + rank, mask=valid, other=float("-inf"))
            top = tl.topk(tl.where(valid, _key(cand, SPAN - 1 - f), lowest), BUDGET)
            index = SPAN - 1 - (top & 0xFFFFFFFF)
            picked = tl.load(Pairs + index, mask=keep, other=0)
            picked_slot = picked // k
            picked_state = tl.load(States + (d - 1) * budget + picked_slot, mask=keep, other=0)
            next_state = tl.load(Order + (d * width + picked_state) * width + picked % k, mask=keep, other=0)
            tl.store(Scores + d * budget + b, _key_score(top), mask=keep)
            tl.store(ParentSlot + d * budget + b, picked_slot, mask=keep)
            tl.store(States + d * budget + b, next_state, mask=keep)
            tl.debug_barrier()
        r, take, cand = _number_best_first(Scores, NodeOf, budget, n, MAX_DEPTH, EVERY, NODES)
        depth = cand // budget
        above = take & (depth > 0)
        parent = tl.load(NodeOf + (depth - 1) * budget + tl.load(ParentSlot + cand, mask=above, other=0),
                         mask=above, other=0)
        parent = tl.where((parent >= 1) & (parent <= r), parent, 0)  # a parent always precedes its child
        chosen = tl.load(States + cand, mask=take, other=0)
        tl.store(Tokens + r, tl.load(Tok + depth * width + chosen, mask=take, other=0), mask=take)
        tl.store(Parents + 1 + r, parent, mask=take)
        tl.store(Depths + 1 + r, depth + 1, mask=take)
        tl.store(Parents + r, tl.zeros_like(parent), mask=r == 0)  # the root
        tl.store(Depths + r, tl.zeros_like(depth), mask=r == 0)
        tl.debug_barrier()
        _ancestor_matrix(Visible, Parents, n, ROWS, MAX_DEPTH)

    @triton.jit
    def _selector_chain_kernel(Order, Tok, Chosen, width, MAX_DEPTH: tl.constexpr):
        """The chain: from the root's row, each depth's rank-0 successor of the previous pick."""
        state = tl.full([], 0, tl.int64)
        for d in range(MAX_DEPTH):
            state = tl.load(Order + (d * width + state) * width)
            tl.store(Chosen + d, tl.load(Tok + d * width + state))
