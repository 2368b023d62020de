"""DDTree construction: the most probable draft prefixes under a node budget, and their visibility mask.

Pure functions over what a drafter proposes: DFlash's independent per-depth distributions, or DFlash2's
first-order transition model over each depth's top-k candidates (`Transitions`), under which a prefix's
probability is the product of its transitions and a node's children are scored with its own token as the
predecessor (dflash2.md §6). Node 0 is the root (the last committed token); nodes are numbered in the order
they are chosen, so every child's index exceeds its parent's, which the mask builder and in-place KV
compaction rely on.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DraftTree:
    """A prefix-closed token tree; index 0 is the root and carries no token of its own."""

    tokens: list[int] = field(default_factory=list)  # tokens[i - 1] is node i's token
    depths: list[int] = field(default_factory=list)  # depths[i - 1] is node i's depth (1..D)
    parents: list[int] = field(default_factory=lambda: [-1])  # parents[i], -1 for the root
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])  # token -> child node, per node
    scores: list[float] = field(default_factory=list)  # scores[i - 1]: draft log-prob of node i's whole prefix

    @property
    def size(self) -> int:
        """Number of draft nodes (root excluded)."""
        return len(self.tokens)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        path = [node]
        while path[-1]:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def deepest(self) -> int:
        """The last-added node of the greatest depth (the root when the tree is empty)."""
        return max(range(self.size + 1), key=lambda n: (self.depths[n - 1] if n else 0, n))

    def add(self, parent: int, token: int, depth: int, score: float = 0.0) -> int:
        node = len(self.parents)
        self.tokens.append(token)
        self.depths.append(depth)
        self.parents.append(parent)
        self.children.append({})
        self.children[parent][token] = node
        self.scores.append(score)
        return node


@dataclass(frozen=True)
class Transitions:
    """A block's first-order draft model (DFlash2's selector): logp [D, k, k], logp[d, i, j] the log-probability
    of candidate j at depth d+1 after candidate i at depth d (depth 1: after the root, in every row), and the
    candidates' token ids tokens [D, k]."""

    logp: torch.Tensor
    tokens: torch.Tensor

    def first(self, depth: int) -> Transitions:
        """The model of the first `depth` depths."""
        return Transitions(self.logp[:depth], self.tokens[:depth])


def chain_tree(tokens: list[int], logps: list[float] | None = None) -> DraftTree:
    """Linear DFlash: one path of the draft's argmax tokens (with their log-probs, each node's prefix scored)."""
    tree = DraftTree()
    node, score = 0, 0.0
    for depth, token in enumerate(tokens, start=1):
        score += logps[depth - 1] if logps is not None else 0.0
        node = tree.add(node, token, depth, score)
    return tree


def top_candidates(draft_logits: torch.Tensor, k: int,
                   token_ids: torch.Tensor | None = None) -> tuple[list[list[float]], list[list[int]]]:
    """Per-depth top-k log-probs and tokens (one fused op and one device-to-host copy); column c of the
    logits is token token_ids[c] when given (a draft vocabulary), else token c."""
    logp, tok = torch.topk(torch.log_softmax(draft_logits.float(), dim=-1), k, dim=-1)
    if token_ids is not None:
        tok = token_ids[tok]
    return logp.cpu().double().tolist(), tok.cpu().tolist()


def build_tree(draft_logits: torch.Tensor, budget: int, *, spine: bool = False,
               token_ids: torch.Tensor | None = None) -> DraftTree:
    """Best-first search for the `budget` most probable prefixes of the per-depth product distribution.

    draft_logits [D, V] are the drafter's raw logits (temperature 1), over the tokens `token_ids` [V] when
    the drafter scores a draft vocabulary (ddtree.draft_vocab). A path's score is the sum of its
    per-depth log-probs, summed in depth order. Ties break on the path's rank tuple (lexicographic), so
    the result is deterministic. With `spine`, the whole top-1 chain is placed first, so small budgets
    still reach full depth.
    """
    if budget <= 0 or draft_logits.shape[0] == 0:
        return DraftTree()
    return tree_from_candidates(*top_candidates(draft_logits, min(budget, draft_logits.shape[1]), token_ids),
                                budget, spine=spine)


def tree_from_candidates(logp: list[list[float]], tok: list[list[int]], budget: int, *,
                         spine: bool = False) -> DraftTree:
    """`build_tree` over per-depth top-k log-probs and tokens already on the host (best first at each depth):
    a batched round takes every request's candidates in one copy and builds each tree from them."""
    if budget <= 0 or not logp:
        return DraftTree()
    # one state per depth: every node's children come from the same row
    return _best_first([[row] for row in logp], [[row] for row in tok], None, budget, spine)


def build_selector_tree(transitions: Transitions, budget: int) -> DraftTree:
    """Best-first search for the `budget` most probable prefixes under a first-order transition model: a node's
    children are its depth's successors of its own candidate, scored by the transitions from it. A prefix
    still outscores its extensions (log-probabilities are <= 0), so the result is prefix-closed, with the same
    order and tie rules as build_tree."""
    if budget <= 0 or transitions.logp.shape[0] == 0:
        return DraftTree()
    logp, order = torch.sort(transitions.logp.double(), dim=-1, descending=True, stable=True)
    return selector_tree_from_sorted(logp.tolist(), order.tolist(), transitions.tokens.tolist(), budget)


def selector_tree_from_sorted(logp: list[list[list[float]]], order: list[list[list[int]]],
                              tokens: list[list[int]], budget: int) -> DraftTree:
    """`build_selector_tree` over transitions already sorted (each row best first) and on the host: logp[d][i]
    the sorted log-probs after candidate i, order[d][i] which candidates they are, tokens[d] the candidates' ids.
    A batched round sorts every request's transitions in one call and builds each tree from them."""
    if budget <= 0 or not logp:
        return DraftTree()
    k = min(budget, len(tokens[0]))
    logp = [[row[:k] for row in depth] for depth in logp]
    order = [[row[:k] for row in depth] for depth in order]
    ids = [[[candidates[j] for j in row] for row in depth] for depth, candidates in zip(order, tokens, strict=True)]
    return _best_first(logp, ids, order, budget, False)


def selector_chain_tree(logp: list[list[list[float]]], order: list[list[list[int]]],
                        tokens: list[list[int]]) -> DraftTree:
    """DFlash2's chain (`selector_chain`: at each depth the best candidate after the previous pick) as a tree whose
    nodes carry their prefixes' log-probabilities under the transition model, from sorted transitions as
    `selector_tree_from_sorted` takes them (the batch budget weighs the chain's nodes by those scores)."""
    tree, state, score = DraftTree(), 0, 0.0
    for depth, (rows, ranks, candidates) in enumerate(zip(logp, order, tokens, strict=True), start=1):
        score += rows[state][0]
        state = ranks[state][0]
        tree.add(depth - 1, candidates[state], depth, score)
    return tree


def selector_chain(transitions: Transitions) -> list[int]:
    """DFlash2's chain: at each depth the best candidate after the previous pick (the anchor first)."""
    tokens, state = [], 0
    for logp, candidates in zip(transitions.logp, transitions.tokens, strict=True):
        state = int(logp[state].argmax())
        tokens.append(int(candidates[state]))
    return tokens


def _best_first(logp: list[list[list[float]]], tok: list[list[list[int]]], succ: list[list[list[int]]] | None,
                budget: int, spine: bool) -> DraftTree:
    """The best-first search of build_tree over rows: logp[d][s] the sorted log-probs (best first) of depth d+1's
    children of a node in state s, tok[d][s] their tokens, succ[d][s] their own states (None: one state, 0).
    The root is in state 0."""
    max_depth, k = len(logp), len(logp[0][0])
    tree = DraftTree()
    # Heap entry: (-score, rank tuple, parent score, parent node, parent state, depth, rank)
    heap: list[tuple[float, tuple[int, ...], float, int, int, int, int]] = []

    def push(parent_score: float, ranks: tuple[int, ...], parent: int, state: int, depth: int, rank: int) -> None:
        score = parent_score + logp[depth - 1][state][rank]
        heapq.heappush(heap, (-score, (*ranks, rank), parent_score, parent, state, depth, rank))

    def child_state(depth: int, state: int, rank: int) -> int:
        return 0 if succ is None else succ[depth - 1][state][rank]

    if spine:
        node, score, ranks, state = 0, 0.0, (), 0
        for depth in range(1, min(budget, max_depth) + 1):
            if k > 1:
                push(score, ranks, node, state, depth, 1)  # the spine node's first sibling
            score, ranks = score + logp[depth - 1][state][0], (*ranks, 0)
            node = tree.add(node, tok[depth - 1][state][0], depth, score)
            state = child_state(depth, state, 0)
    else:
        push(0.0, (), 0, 0, 1, 0)
    while heap and tree.size < budget:
        neg_score, ranks, parent_score, parent, state, depth, rank = heapq.heappop(heap)
        node = tree.add(parent, tok[depth - 1][state][rank], depth, -neg_score)
        if rank + 1 < k:
            push(parent_score, ranks[:-1], parent, state, depth, rank + 1)
        if depth < max_depth:
            push(-neg_score, ranks, node, child_state(depth, state, rank), depth + 1, 0)
    return tree


def visibility(tree: DraftTree) -> torch.Tensor:
    """bool [N, N] (N = size + 1): row i sees its ancestors and itself."""
    n = tree.size + 1
    vis = np.zeros((n, n), dtype=np.bool_)  # numpy rows: a batched round builds one per request, on the host
    vis[0, 0] = True
    for i in range(1, n):
        vis[i] = vis[tree.parents[i]]
        vis[i, i] = True
    return torch.from_numpy(vis)


def walk(tree: DraftTree, picks: list[int]) -> list[int]:
    """Follow the target's picks from the root while they match a child; returns the path of nodes.

    picks[i] is the target's token at node i. The emitted tokens are picks[path[j]] for every j: the
    accepted children's tokens followed by the bonus token at the last node.
    """
    path = [0]
    node = 0
    while (child := tree.children[node].get(picks[node])) is not None:
        path.append(child)
        node = child
    return path
