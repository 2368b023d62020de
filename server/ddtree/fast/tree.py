"""DDTree construction on the device: static shapes, a few dozen kernels, no host synchronisation.

Same trees as ddtree.tree (the host's best-first search), as tensors a CUDA graph can replay.
"""

from __future__ import annotations

import torch

from ddtree.fast.jit import triton_works

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch loop below
    triton = None


def tree_size(max_depth: int, vocab: int, budget: int) -> int:
    """Draft nodes a budget-`budget` tree holds: the budget, unless fewer prefixes exist at all."""
    k = min(budget, vocab)
    return min(budget, sum(min(budget, k**d) for d in range(1, max_depth + 1)))


def top_prefixes(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """The `budget` most probable prefixes of the per-depth product distribution, as tensors on the device.

    Same set as tree.build_tree (barring exact score ties). The best `budget` prefixes of depth d can only
    extend the best `budget` of depth d-1 (a prefix scores at least as well as its extensions), so every
    depth keeps exactly `budget` slots, sorted best first (unused ones score -inf). Extending slot i by the
    j-th best token is beaten by every (i' <= i, j' <= j), so only the (i+1)(j+1) <= budget "frontier"
    pairs can make the cut: one small sort per depth (~B ln B candidates, not B * k) finds them. One
    stable sort by score (shallower first on ties) then numbers the nodes best-first, so every parent
    precedes its children. Returns (tokens [N-1], parents [N], depths [N]), N = nodes + 1 with the root
    at 0 (parent 0, depth 0).
    """
    logits = draft_logits.float()
    max_depth, vocab = logits.shape
    k = min(budget, vocab)
    device = logits.device
    top, tok = logits.topk(k, dim=-1)  # fused top-k, sorted: log-probs are the top logits minus the log-partition
    logp = top - logits.logsumexp(dim=-1, keepdim=True)
    pairs = _frontier(budget, k, device)
    n = tree_size(max_depth, vocab, budget)
    if logits.is_cuda and triton_works(logits.device):
        return _build_on_gpu(logp, tok, pairs, budget, n)
    scores = logp.new_full((max_depth, budget), float("-inf"))
    scores[0, :k] = logp[0]
    picks = torch.arange(budget, device=device).remainder(k).repeat(max_depth, 1)  # flat index into [budget x k]
    for d in range(1, max_depth):
        best, order = (scores[d - 1, :, None] + logp[d]).flatten()[pairs].sort(descending=True, stable=True)
        scores[d], picks[d] = best[:budget], pairs[order[:budget]]
    depth = torch.arange(max_depth, device=device)[:, None]
    tokens = tok.gather(1, picks.remainder(k))
    parent_slot = torch.where(depth > 0, (depth - 1) * budget + picks.div(k, rounding_mode="floor"), -1)
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[:n]
    node_of = torch.zeros(max_depth * budget, dtype=torch.long, device=device)
    node_of[order] = torch.arange(1, n + 1, device=device)
    parent = parent_slot.flatten()[order]
    root = torch.zeros(1, dtype=torch.long, device=device)
    parents = torch.cat([root, torch.where(parent >= 0, node_of[parent.clamp(min=0)], 0)])
    return tokens.flatten()[order], parents, torch.cat([root, order.div(budget, rounding_mode="floor") + 1])


_FRONTIERS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _frontier(budget: int, k: int, device: torch.device) -> torch.Tensor:
    """Flat indices i * k + j of the (slot i, token j) pairs with (i+1)(j+1) <= budget, i-major.

    Cached per device: made on the first (warm-up) call, so a CUDA graph capture never copies from the host.
    """
    key = (budget, k, device)
    if key not in _FRONTIERS:
        pairs = [i * k + j for i in range(budget) for j in range(k) if (i + 1) * (j + 1) <= budget]
        _FRONTIERS[key] = torch.tensor(pairs, device=device)
    return _FRONTIERS[key]


def _build_on_gpu(logp: torch.Tensor, tok: torch.Tensor, pairs: torch.Tensor, budget: int,
                  n: int) -> tuple[torch.Tensor, ...]:
    """top_prefixes after the vocabulary top-k, as one Triton program: a kernel launch costs more than a
    depth's work, so the per-depth loop, the best-first numbering and the parent lookup run in one launch."""
    max_depth, k = logp.shape
    device = logp.device
    span = max(16, triton.next_power_of_2(pairs.numel()))
    every = max(16, triton.next_power_of_2(max_depth * budget))
    scores = torch.empty((max_depth, budget), dtype=torch.float32, device=device)
    picks = torch.empty((max_depth, budget), dtype=torch.int64, device=device)
    scratch = torch.empty(max(span, every), dtype=torch.int64, device=device)
    node_of = torch.empty(max_depth * budget, dtype=torch.int64, device=device)
    tokens = torch.empty(n, dtype=torch.int64, device=device)
    parents = torch.empty(n + 1, dtype=torch.int64, device=device)
    depths = torch.empty(n + 1, dtype=torch.int64, device=device)
    _tree_kernel[(1,)](logp, tok, pairs, scores, picks, scratch, node_of, tokens, parents, depths, pairs.numel(), k,
                       budget, n, MAX_DEPTH=max_depth, SPAN=span, BUDGET=max(16, triton.next_power_of_2(budget)),
                       EVERY=every, NODES=max(16, triton.next_power_of_2(n)), num_warps=4)
    return tokens, parents, depths


if triton is not None:

    @triton.jit
    def _key(score, rank):
        """int64 sort key: an order-preserving integer image of the float score, then `rank` (ties)."""
        bits = score.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
        return (ordered.to(tl.int64) << 32) | rank.to(tl.int64)

    @triton.jit
    def _key_score(key):
        high = (key >> 32).to(tl.int32)
        return (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _tree_kernel(Logp, Tok, Pairs, Scores, Picks, Scratch, NodeOf, Tokens, Parents, Depths, num_pairs, k, budget,
                     n, MAX_DEPTH: tl.constexpr, SPAN: tl.constexpr, BUDGET: tl.constexpr, EVERY: tl.constexpr,
                     NODES: tl.constexpr):
        """The PyTorch path of top_prefixes, step for step. Sorting keys carry the complement of an index in
        their low bits, so one descending integer sort breaks score ties like a stable sort does."""
        lowest = -9223372036854775807
        b = tl.arange(0, BUDGET)
        keep = b < budget
        tl.store(Scores + b, tl.load(Logp + b, mask=b < k, other=float("-inf")), mask=keep)  # depth 0
        tl.store(Picks + b, (b % k).to(tl.int64), mask=keep)
        f = tl.arange(0, SPAN)
        valid = f < num_pairs
        pair = tl.load(Pairs + f, mask=valid, other=0)
        slot, token = pair // k, pair % k
        tl.debug_barrier()
        for d in range(1, MAX_DEPTH):  # the best `budget` frontier extensions of depth d-1's slots
            cand = tl.load(Scores + (d - 1) * budget + slot, mask=valid, other=float("-inf"))
            cand += tl.load(Logp + d * k + token, mask=valid, other=float("-inf"))
            key = tl.where(valid, _key(cand, SPAN - 1 - f), lowest)
            tl.store(Scratch + f, tl.sort(key, descending=True))
            tl.debug_barrier()
            top = tl.load(Scratch + b, mask=keep, other=0)
            tl.store(Scores + d * budget + b, _key_score(top), mask=keep)
            index = SPAN - 1 - (top & 0xFFFFFFFF)
            tl.store(Picks + d * budget + b, tl.load(Pairs + index, mask=keep, other=0), mask=keep)
            tl.debug_barrier()
        e = tl.arange(0, EVERY)  # best-first numbering of all depths' slots: node r + 1 is the r-th best
        inside = e < MAX_DEPTH * budget
        key = tl.where(inside, _key(tl.load(Scores + e, mask=inside, other=float("-inf")), EVERY - 1 - e), lowest)
        tl.store(Scratch + e, tl.sort(key, descending=True))
        tl.debug_barrier()
        r = tl.arange(0, NODES)
        take = r < n
        cand = EVERY - 1 - (tl.load(Scratch + r, mask=take, other=0) & 0xFFFFFFFF)
        tl.store(NodeOf + cand, (r + 1).to(tl.int64), mask=take)
        tl.debug_barrier()
        depth = cand // budget
        pick = tl.load(Picks + cand, mask=take, other=0)
        parent = tl.load(NodeOf + (depth - 1) * budget + pick // k, mask=take & (depth > 0), other=0)
        parent = tl.where((parent >= 1) & (parent <= r), parent, 0)  # a parent always precedes its child
        tl.store(Tokens + r, tl.load(Tok + depth * k + pick % k, mask=take, other=0), mask=take)
        tl.store(Parents + 1 + r, parent, mask=take)
        tl.store(Depths + 1 + r, depth + 1, mask=take)
        tl.store(Parents + r, tl.zeros_like(parent), mask=r == 0)  # the root
        tl.store(Depths + r, tl.zeros_like(depth), mask=r == 0)


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
