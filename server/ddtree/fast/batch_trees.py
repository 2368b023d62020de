"""A batched round's draft trees, every request's at once, as arrays: built together, cut by the batch budget, laid
out as verify rows and walked together.

A request's tree is DDTree's (kernels/tree.py `batch_prefixes`: every ddtree block in one launch on a GPU), a
DFlash chain (each depth's most probable token), DFlash2's selector tree or chain (core/tree.py), or nothing
(`ar`). Nodes are numbered best first, so every cut (the request's own budget, then the batch budget of
core/budget.py) keeps a prefix of its nodes, and a tree is its first `sizes[r]` nodes. The walk of the target's
picks runs over every request's rows at once (`accepted_paths`), as does the ancestor matrix (`visibility`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.core.tree import DraftTree
from ddtree.kernels.tree import batch_prefixes, vocab_top


@dataclass
class RoundTrees:
    """Every request's tree of one round. Node 0 is the root (the request's last token); node i's token is
    tokens[r, i - 1]. Only a request's first sizes[r] nodes exist."""

    tokens: np.ndarray  # [R, N] int64
    parents: np.ndarray  # [R, N + 1] int64, the root's 0
    depths: np.ndarray  # [R, N + 1] int64, the root's 0
    scores: np.ndarray  # [R, N] float64: each node's prefix log-probability under the drafter, best first
    sizes: np.ndarray  # [R] int64

    @classmethod
    def empty(cls, requests: int, nodes: int = 0) -> RoundTrees:
        """`requests` trees of no node (room for `nodes` each)."""
        return cls(np.zeros((requests, nodes), np.int64), np.zeros((requests, nodes + 1), np.int64),
                   np.zeros((requests, nodes + 1), np.int64), np.full((requests, nodes), -np.inf),
                   np.zeros(requests, np.int64))

    @classmethod
    def of(cls, trees: Sequence[DraftTree]) -> RoundTrees:
        """Trees built on the host (DFlash2's), best first, as arrays."""
        out = cls.empty(len(trees), max((t.size for t in trees), default=0))
        for r, tree in enumerate(trees):
            n = tree.size
            out.tokens[r, :n], out.scores[r, :n] = tree.tokens, tree.scores
            out.parents[r, 1:n + 1], out.depths[r, 1:n + 1] = tree.parents[1:], tree.depths
            out.sizes[r] = n
        return out

    def put(self, rows: Sequence[int], part: RoundTrees) -> None:
        """Requests `rows` take `part`'s trees (at most as many nodes as these arrays hold)."""
        n = part.tokens.shape[1]
        index = np.asarray(rows, dtype=np.int64)
        self.tokens[index, :n], self.scores[index, :n] = part.tokens, part.scores
        self.parents[index, :n + 1], self.depths[index, :n + 1] = part.parents, part.depths
        self.sizes[index] = part.sizes

    def cut(self, sizes: Sequence[int]) -> None:
        """Keep each request's first sizes[r] nodes (its most probable prefixes)."""
        self.sizes = np.minimum(self.sizes, np.asarray(sizes, dtype=np.int64))

    def verified(self, paths: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The verified nodes' scores and whether the target accepted each (on its request's path: node ids, the
        root first), what the batch budget's calibration learns from."""
        accepted = np.zeros(self.scores.shape, dtype=np.bool_)
        for r, path in enumerate(paths):
            accepted[r, [node - 1 for node in path[1:]]] = True
        verified = np.arange(self.scores.shape[1]) < self.sizes[:, None]
        return self.scores[verified], accepted[verified]

    def live_scores(self) -> np.ndarray:
        """Scores of the nodes that exist, -inf past each request's size (the batch budget's candidates)."""
        return np.where(np.arange(self.scores.shape[1]) < self.sizes[:, None], self.scores, -np.inf)

    def tree(self, r: int) -> DraftTree:
        """Request r's tree as a DraftTree (what the per-request pick of sampled or constrained requests walks)."""
        tree = DraftTree()
        for i in range(1, int(self.sizes[r]) + 1):
            tree.add(int(self.parents[r, i]), int(self.tokens[r, i - 1]), int(self.depths[r, i]),
                     float(self.scores[r, i - 1]))
        return tree

    def lineage(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Request r's parents (the root's -1) and depths, root first (a hybrid verify's rows: SeqRows)."""
        n = int(self.sizes[r]) + 1
        parents = self.parents[r, :n].copy()
        parents[0] = -1
        return parents, self.depths[r, :n]

    def visibility(self) -> tuple[list[torch.Tensor], np.ndarray]:
        """Per request, bool [n + 1, n + 1]: row i sees its ancestors and itself (all requests in one pass); and all
        of them flattened and concatenated, as the verify's kernels read them."""
        requests, width = self.parents.shape
        seen = np.zeros(requests * width * width, dtype=np.bool_)
        cells = (np.arange(requests)[:, None] * width + np.arange(width)) * width  # each node's row of `seen`
        up = np.broadcast_to(np.arange(width), (requests, width))
        seen[cells + up] = True
        for _ in range(int(self.depths.max(initial=0))):
            up = np.take_along_axis(self.parents, up, axis=1)
            seen[cells + up] = True
        seen = seen.reshape(requests, width, width)
        n = self.sizes + 1
        node = np.arange(width)
        kept = (node[None, :, None] < n[:, None, None]) & (node[None, None, :] < n[:, None, None])
        return [torch.from_numpy(seen[r, :k, :k]) for r, k in enumerate(n.tolist())], seen[kept]


def dflash_trees(drafted: torch.Tensor, methods: Sequence[str], budgets: Sequence[int], depths: Sequence[int],
                 token_ids: torch.Tensor | None) -> RoundTrees:
    """The trees of drafting requests from their blocks' draft logits [R, D, V]: DDTree's best-first tree at each
    request's budget (all built in one call at the largest), or a chain for `dflash`; a request drafts only its
    first depths[r] depths (its context's end). One copy to the host for the whole batch."""
    requests, max_depth, vocab = drafted.shape
    trees = [r for r, m in enumerate(methods) if m == "ddtree"]
    budget = max((budgets[r] for r in trees), default=1)
    logp, tok = vocab_top(drafted.reshape(requests * max_depth, vocab), min(budget, vocab), token_ids)
    logp, tok = logp.view(requests, max_depth, -1), tok.view(requests, max_depth, -1)
    limits = torch.tensor(depths, device=logp.device)
    logp = logp.masked_fill(torch.arange(max_depth, device=logp.device)[None, :, None] >= limits[:, None, None],
                            float("-inf"))
    chains = [r for r, m in enumerate(methods) if m != "ddtree"]
    pieces = []  # on the device, as float64 (ids are exact there): one copy brings every request's tree
    if chains:  # each depth's most probable token, under its parent
        pieces.append(torch.cat([logp[chains, :, 0].double(), tok[chains, :, 0].double()], dim=1))
    n = 0
    if trees:
        tokens, parents, node_depths, scores = batch_prefixes(logp[trees].contiguous(), tok[trees].contiguous(),
                                                              budget)
        n = tokens.shape[1]
        pieces.append(torch.cat([tokens.double(), parents.double(), node_depths.double(), scores.double()], dim=1))
    host = torch.cat([piece.flatten() for piece in pieces]).cpu().numpy()
    out = RoundTrees.empty(requests, max(max_depth, n))
    if chains:
        count = len(chains)
        head, host = host[:count * 2 * max_depth].reshape(count, -1), host[count * 2 * max_depth:]
        steps = np.arange(max_depth + 1)[None].repeat(count, 0)  # node i at depth i, under node i - 1
        out.put(chains, RoundTrees(head[:, max_depth:].astype(np.int64), np.maximum(steps - 1, 0), steps,
                                   np.cumsum(head[:, :max_depth], axis=1),
                                   np.asarray([depths[r] for r in chains], dtype=np.int64)))
    if trees:
        packed = host.reshape(len(trees), -1)
        ids, scores = packed[:, :3 * n + 2].astype(np.int64), packed[:, 3 * n + 2:]
        own = np.asarray([budgets[r] for r in trees], dtype=np.int64)
        out.put(trees, RoundTrees(ids[:, :n], ids[:, n:2 * n + 1], ids[:, 2 * n + 1:], scores,
                                  np.minimum((scores > -np.inf).sum(axis=1), own)))
    return out


def accepted_paths(trees: RoundTrees, picks: np.ndarray, offsets: Sequence[int]) -> list[list[int]]:
    """Each request's accepted path (its nodes from the root): the walk of the target's picks over every request's
    rows at once. picks[offsets[r] + i] is the target's token at request r's node i; a node is accepted when the
    pick at its parent is its token and its parent is accepted (siblings hold distinct tokens, so the accepted
    nodes of a request form one path from its root)."""
    requests, width = trees.parents.shape
    node = np.arange(width)
    exists = node[None] <= trees.sizes[:, None]
    at = np.minimum(np.asarray(offsets[:-1], dtype=np.int64)[:, None] + node[None], len(picks) - 1)
    picked = np.where(exists, picks[at], -1)  # the target's pick at each node
    own = np.concatenate([np.full((requests, 1), -2), trees.tokens], axis=1)  # each node's token (the root: none)
    matches = exists & (np.take_along_axis(picked, trees.parents, axis=1) == own)
    matches[:, 0] = True
    accepted = matches
    for _ in range(int(trees.depths.max(initial=0))):  # acceptance flows down one level a pass
        accepted = matches & np.take_along_axis(accepted, trees.parents, axis=1)
    deepest = np.argmax(np.where(accepted, trees.depths, -1), axis=1)
    paths = []
    for r, last in enumerate(deepest.tolist()):
        path = [last]
        while path[-1]:
            path.append(int(trees.parents[r, path[-1]]))
        paths.append(path[::-1])
    return paths
