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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Seconds of one batched round: a piecewise-linear function of the tokens the target verifies (draft nodes
    plus one root per request), plus a cost per request (its share of the draft step, tree and commit).

    `points` are (verified tokens, seconds) in increasing tokens; between them the time is interpolated, past the
    last it grows along the last segment (flat for a single point)."""

    points: tuple[tuple[int, float], ...]
    per_request: float = 0.0
    overhead: float = 0.0  # the rest of a step (host work, tree, commit), measured while serving (`RoundChoice`)

    def __post_init__(self) -> None:
        if not self.points or any(b[0] <= a[0] for a, b in zip(self.points, self.points[1:], strict=False)):
            raise ValueError("a cost model needs points in strictly increasing token counts")
        if any(seconds <= 0 for _, seconds in self.points) or self.per_request < 0 or self.overhead < 0:
            raise ValueError("a cost model's times must be positive")

    def seconds(self, tokens: int, requests: int) -> float:
        return float(self.seconds_at(np.array([tokens]), requests)[0])

    def seconds_at(self, tokens: np.ndarray, requests: int) -> np.ndarray:
        """`seconds` at every token count of `tokens` in one pass (a round weighs hundreds of totals)."""
        xs = np.array([x for x, _ in self.points], dtype=np.float64)
        ys = np.array([y for _, y in self.points], dtype=np.float64)
        t = np.asarray(tokens, dtype=np.float64)
        if len(xs) == 1:
            verify = np.full(t.shape, ys[0])
        else:
            lo = np.clip(np.searchsorted(xs, t, side="left") - 1, 0, len(xs) - 2)
            verify = ys[lo] + (ys[lo + 1] - ys[lo]) * (t - xs[lo]) / (xs[lo + 1] - xs[lo])
        return np.maximum(verify, ys.min()) + self.per_request * requests + self.overhead


FLAT = CostModel(((1, 1.0),))  # every round costs the same: each request verifies its whole tree


def _matrix(scores: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    """Requests' node scores as one float64 matrix [requests, nodes], -inf where a request has no such node."""
    if isinstance(scores, np.ndarray):
        return scores.astype(np.float64, copy=False).reshape(len(scores), -1)
    out = np.full((len(scores), max((len(s) for s in scores), default=0)), -np.inf)
    for r, s in enumerate(scores):
        out[r, :len(s)] = s
    return out


def _merge(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every node in the order a best-first merge over the requests takes them: highest score first, ties to the
    earlier request (each request's own nodes are already best first). Returns (their requests, their scores)."""
    flat = scores.ravel()
    real = np.flatnonzero(flat > -np.inf)
    taken = real[np.argsort(-flat[real], kind="stable")]
    return taken // max(scores.shape[1], 1), flat[taken]


def chosen_nodes(scores: Sequence[Sequence[float]] | np.ndarray, total: int) -> list[int]:
    """How many of its best nodes each request verifies when the round verifies `total` draft nodes in all: the
    `total` highest-scoring nodes over every request. `scores[r]` are request r's node log-probabilities in
    its tree's order (non-increasing for a best-first tree, which keeps every chosen set prefix-closed; -inf:
    no node); ties go to the earlier request."""
    matrix = _matrix(scores)
    requests, _ = _merge(matrix)
    return np.bincount(requests[:max(total, 0)], minlength=len(matrix)).tolist()


def expected_tokens(scores: Sequence[Sequence[float]], counts: Sequence[int]) -> float:
    """Expected tokens the round commits: each request's bonus plus the draft probability of every chosen node."""
    return sum(1.0 + sum(math.exp(x) for x in s[:n]) for s, n in zip(scores, counts, strict=True))


class Calibration:
    """How often the target accepts a draft node the drafter gave prefix probability p, learnt from the rounds
    verified: the batch budget's expected tokens are the drafter's probabilities corrected by it.

    A drafter is rarely calibrated (the demo drafter undersells its trees: benchmarks/drafter_calibration.py), and
    one that undersells makes an uncorrected budget stop short of trees that would pay. Nodes
    are binned by log probability; each bin keeps decayed sums of the probability it forecast and of the nodes
    accepted, and a node's expected acceptance is p times its bin's ratio (never above 1), the ratio pulled
    towards 1 by `prior` forecast tokens, so a bin seen little keeps the drafter's own figure."""

    EDGES = np.log(np.geomspace(1e-4, 1.0, 13)[1:-1])  # 12 bins of probability, log-spaced from 1e-4 to 1

    def __init__(self, prior: float = 4.0, decay: float = 0.995) -> None:
        self.prior, self.decay = prior, decay
        self.forecast = np.zeros(len(self.EDGES) + 1)
        self.accepted = np.zeros(len(self.EDGES) + 1)

    def observe(self, scores: np.ndarray, accepted: np.ndarray) -> None:
        """One round's verified nodes: their log probabilities and whether the target accepted each."""
        bins = np.searchsorted(self.EDGES, scores)
        self.forecast = self.decay * self.forecast + np.bincount(bins, np.exp(scores), len(self.forecast))
        self.accepted = self.decay * self.accepted + np.bincount(bins, accepted, len(self.accepted))

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        """Expected acceptance of nodes with these log probabilities."""
        ratio = (self.accepted + self.prior) / (self.forecast + self.prior)
        return np.minimum(np.exp(scores) * ratio[np.searchsorted(self.EDGES, scores)], 1.0)


def choose_nodes(scores: Sequence[Sequence[float]] | np.ndarray, cost: CostModel,
                 totals: Sequence[int] | None = None, calibration: Calibration | None = None) -> list[int]:
    """Per request, the draft nodes to verify this round: the split of the total, among `totals` (every count
    from 0 to all candidates when None), that maximises expected committed tokens per second of round time
    (the smallest such total, within a relative 1e-9).

    One merge of every request's nodes, best first: the split at total t is the first t nodes taken, and the
    expected tokens at t are the requests' bonus tokens plus the running sum of those nodes' probabilities (as
    `calibration` corrects them, kept non-increasing along the merge), so every total is weighed in one
    vectorised pass (a round weighs hundreds of them, between draft and verify)."""
    matrix = _matrix(scores)
    requests, merged = _merge(matrix)
    available = len(merged)
    allowed = np.arange(available + 1) if totals is None else np.array(
        sorted({min(t, available) for t in totals if t >= 0}) or [0])
    gains = np.exp(merged) if calibration is None else np.minimum.accumulate(calibration(merged))
    expected = len(matrix) + np.concatenate([[0.0], np.cumsum(gains)])
    rates = expected[allowed] / cost.seconds_at(len(matrix) + allowed, len(matrix))
    best = int(allowed[np.flatnonzero(rates >= rates.max() * (1 - 1e-9))[0]])
    return np.bincount(requests[:best], minlength=len(matrix)).tolist()


def batch_bucket(requests: int) -> int:
    """Batch sizes measured together: each up to 8, then steps of a quarter of a power of two (9-10, 11-12, ...,
    15-16, 17-20, ...)."""
    if requests <= 8:
        return requests
    top = 1 << (requests - 1).bit_length()
    return next(b for b in (top * 5 // 8, top * 3 // 4, top * 7 // 8, top) if b >= requests)


@dataclass
class RoundChoice:
    """Whether a batch's round drafts, and what a drafting round really costs, from the steps it measures.

    A drafting round commits tau tokens a request for a step of T_draft(S) seconds, a plain (ar) round one token
    for T_plain(S): a round drafts while tau / T_draft >= 1 / T_plain at its batch size S (bucketed). Both are
    step periods as served (host work, launches, waits), so a round never drafts where drafting loses to plain
    decoding; every `explore` rounds the other kind runs once, so a measurement never goes stale. A drafting step's
    time beyond the verify's measured cost is the cost model's `overhead`, for the batch budget to weigh, kept by
    batch bucket: the host's share of a step grows with its requests (a 64-request step's is ten times a
    4-request step's), so one figure averaged over the sizes a server passes through fits none of them."""

    alpha: float = 0.2
    explore: int = 50
    draft_seconds: dict[int, float] = field(default_factory=dict)
    plain_seconds: dict[int, float] = field(default_factory=dict)
    tokens_per_request: float = 2.0  # committed per request by a drafting round (bonus included)
    overhead: dict[int, float] = field(default_factory=dict)  # seconds, by batch bucket
    rounds: int = 0

    def drafts(self, requests: int) -> bool:
        bucket = batch_bucket(requests)
        drafting, plain = self.draft_seconds.get(bucket), self.plain_seconds.get(bucket)
        self.rounds += 1
        if drafting is None or plain is None:  # measure each kind once
            return drafting is None
        better = self.tokens_per_request / drafting >= 1.0 / plain
        return better != (self.rounds % self.explore == 0)

    def overhead_at(self, requests: int) -> float:
        """A drafting step's seconds beyond the verify's modelled cost at this batch size: its bucket's measure,
        else the nearest measured bucket's (the smaller on a tie), 0 before any drafting step is measured."""
        if not self.overhead:
            return 0.0
        bucket = batch_bucket(requests)
        return self.overhead[min(self.overhead, key=lambda b: (abs(b - bucket), b))]

    def observe(self, requests: int, drafted: bool, seconds: float, committed: int,
                verify: float | None = None) -> None:
        """One step's period: `requests` sequences, drafting or not, committing `committed` tokens in all;
        `verify`: the cost model's seconds for the round without overhead (a drafting round's)."""
        bucket = batch_bucket(requests)
        table = self.draft_seconds if drafted else self.plain_seconds
        table[bucket] = seconds if bucket not in table else (1 - self.alpha) * table[bucket] + self.alpha * seconds
        if drafted:
            self.tokens_per_request += self.alpha * (committed / requests - self.tokens_per_request)
            if verify is not None:
                sample = max(seconds - verify, 0.0)
                last = self.overhead.get(bucket, sample)
                self.overhead[bucket] = last + self.alpha * (sample - last)
