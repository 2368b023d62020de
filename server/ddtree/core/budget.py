"""One verification budget for a whole batch: how many draft nodes each request's tree gets in a round.

A DDTree is the set of prefixes with the highest draft probability, and the sum of those probabilities is the
expected number of accepted tokens (each request also commits its bonus token). Summed over a batch, it is the
batch's expected output. So the round's nodes are chosen best-first across every request's candidates, and
how many to verify in all is the count that maximises expected committed tokens per second of round time,
under a cost model of the round measured on the device (`CostModel`). With one request and a flat cost this is
the request's own budget; as the batch grows and verified tokens start to cost time, trees shrink toward
chains, and toward plain `ar` (no draft nodes at all) where that is faster.

A request's own budget stays an upper bound on its tree: each request's candidate list is its best-first
tree at that budget, and a best-first tree's first n nodes are its n most probable prefixes.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Seconds of one batched round: a piecewise-linear function of the tokens the target verifies (draft nodes
    plus one root per request), plus a cost per request (its share of the draft step, tree and commit).

    `points` are (verified tokens, seconds) in increasing tokens; between them the time is interpolated, past the
    last it grows along the last segment (flat for a single point)."""

    points: tuple[tuple[int, float], ...]
    per_request: float = 0.0

    def __post_init__(self) -> None:
        if not self.points or any(b[0] <= a[0] for a, b in zip(self.points, self.points[1:], strict=False)):
            raise ValueError("a cost model needs points in strictly increasing token counts")
        if any(seconds <= 0 for _, seconds in self.points) or self.per_request < 0:
            raise ValueError("a cost model's times must be positive")

    def seconds(self, tokens: int, requests: int) -> float:
        xs = [x for x, _ in self.points]
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs) and xs[i] == tokens:
            verify = self.points[i][1]
        elif len(xs) == 1:
            verify = self.points[0][1]
        else:
            lo = max(0, min(i - 1, len(xs) - 2))
            (x0, y0), (x1, y1) = self.points[lo], self.points[lo + 1]
            verify = y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return max(verify, min(y for _, y in self.points)) + self.per_request * requests


FLAT = CostModel(((1, 1.0),))  # every round costs the same: each request verifies its whole tree


def chosen_nodes(scores: Sequence[Sequence[float]], total: int) -> list[int]:
    """How many of its best nodes each request verifies when the round verifies `total` draft nodes in all: the
    `total` highest-scoring nodes over every request. `scores[r]` are request r's node log-probabilities in
    its tree's order (non-increasing for a best-first tree, which keeps every chosen set prefix-closed); ties
    go to the earlier request."""
    counts = [0] * len(scores)
    heap = [(-s[0], r) for r, s in enumerate(scores) if s]
    heapq.heapify(heap)
    for _ in range(max(total, 0)):
        if not heap:
            break
        _, r = heapq.heappop(heap)
        counts[r] += 1
        if counts[r] < len(scores[r]):
            heapq.heappush(heap, (-scores[r][counts[r]], r))
    return counts


def expected_tokens(scores: Sequence[Sequence[float]], counts: Sequence[int]) -> float:
    """Expected tokens the round commits: each request's bonus plus the draft probability of every chosen node."""
    return sum(1.0 + sum(math.exp(x) for x in s[:n]) for s, n in zip(scores, counts, strict=True))


def choose_nodes(scores: Sequence[Sequence[float]], cost: CostModel,
                 totals: Sequence[int] | None = None) -> list[int]:
    """Per request, the draft nodes to verify this round: the split of the total, among `totals` (every count
    from 0 to all candidates when None), that maximises expected committed tokens per second of round time.

    One best-first pass over every request's nodes: the split at total t is the first t nodes taken, and the
    expected tokens grow by each node's probability, so every total is weighed in O(log requests) (a round
    weighs thousands of them, on the host, between the draft and the verify)."""
    requests = len(scores)
    available = sum(len(s) for s in scores)
    options = {min(t, available) for t in (range(available + 1) if totals is None else totals) if t >= 0} or {0}
    taken: list[int] = []  # the request of each node, in the order the merge takes them
    heap = [(-s[0], r) for r, s in enumerate(scores) if s]
    heapq.heapify(heap)
    counts = [0] * requests
    expected = float(requests)  # every request commits its bonus token
    best_total, best_rate = 0, -1.0
    for total in range(max(options) + 1):
        if total:
            negative, r = heapq.heappop(heap)
            taken.append(r)
            expected += math.exp(-negative)
            counts[r] += 1
            if counts[r] < len(scores[r]):
                heapq.heappush(heap, (-scores[r][counts[r]], r))
        if total in options:
            rate = expected / cost.seconds(requests + total, requests)
            if rate > best_rate * (1 + 1e-9):  # the smallest total among equals: fewer tokens for the same rate
                best_total, best_rate = total, rate
    best = [0] * requests
    for r in taken[:best_total]:
        best[r] += 1
    return best
