"""The batch budget: a round's draft nodes go to the most probable prefixes over every request, and as many as
maximise expected committed tokens per second of round time under the cost model."""

import math
import random

import numpy as np
import pytest
from ddtree.core.budget import FLAT, Calibration, CostModel, choose_nodes, chosen_nodes, expected_tokens
from ddtree.core.tree import tree_from_candidates


def scores_of(*probabilities: list[float]) -> list[list[float]]:
    return [[math.log(p) for p in ps] for ps in probabilities]


def test_the_total_goes_to_the_best_nodes_over_all_requests():
    scores = scores_of([0.9, 0.5, 0.1], [0.8, 0.7, 0.6, 0.05])
    assert chosen_nodes(scores, 0) == [0, 0]
    assert chosen_nodes(scores, 3) == [1, 2]  # 0.9, 0.8, 0.7
    assert chosen_nodes(scores, 5) == [2, 3]  # + 0.6, 0.5
    assert chosen_nodes(scores, 100) == [3, 4]  # never more than a request has


def test_a_request_never_gets_more_than_its_own_tree():
    """Each request's candidates are its best-first tree at its own budget: a low budget caps it however
    probable its next nodes would be."""
    logp = [[math.log(0.9), math.log(0.05)]] * 4
    tok = [[1, 2]] * 4
    small, large = tree_from_candidates(logp, tok, 2), tree_from_candidates(logp, tok, 6)
    assert small.size == 2 and large.size == 6
    assert chosen_nodes([small.scores, large.scores], 8) == [2, 6]


def test_a_flat_cost_verifies_every_candidate():
    scores = scores_of([0.9, 0.5], [0.3])
    assert choose_nodes(scores, FLAT) == [2, 1]


def test_a_steep_cost_shrinks_trees_toward_chains_then_to_plain_steps():
    scores = scores_of([0.9, 0.85, 0.8, 0.3, 0.2, 0.1], [0.9, 0.2, 0.1])
    # verified tokens cost time: each node must pay for itself
    cost = CostModel(((2, 1.0), (100, 1.0 + 98 * 0.25)))
    counts = choose_nodes(scores, cost)
    assert 0 < sum(counts) < 9 and counts[0] >= 3 and counts[1] >= 1
    assert expected_tokens(scores, counts) / cost.seconds(2 + sum(counts), 2) >= max(
        expected_tokens(scores, c) / cost.seconds(2 + sum(c), 2) for c in ([6, 3], [0, 0], [1, 1]))
    # so expensive that no draft node pays: plain autoregressive steps
    assert choose_nodes(scores, CostModel(((2, 1.0), (3, 10.0)))) == [0, 0]


def test_one_request_with_a_flat_round_is_todays_ddtree():
    """With one request and a round whose time does not depend on its tokens (a batch-1 GPU round), the
    request verifies its whole budget-sized tree."""
    scores = scores_of([0.95 ** i for i in range(1, 33)])
    cost = CostModel(((1, 5.0), (64, 5.0)))
    assert choose_nodes(scores, cost) == [32]


def test_totals_limit_the_choice():
    scores = scores_of([0.9, 0.8, 0.7], [0.6])
    assert sum(choose_nodes(scores, FLAT, range(3))) == 2


def test_the_cost_model_interpolates_and_rejects_nonsense():
    cost = CostModel(((10, 1.0), (20, 3.0)), per_request=0.5)
    assert cost.seconds(15, 2) == pytest.approx(2.0 + 1.0)
    assert cost.seconds(30, 0) == pytest.approx(5.0)  # past the last point: along the last segment
    assert cost.seconds(5, 0) == pytest.approx(1.0)  # never below the cheapest measured round
    with pytest.raises(ValueError):
        CostModel(((10, 1.0), (10, 2.0)))
    with pytest.raises(ValueError):
        CostModel(((10, 0.0),))


def rate_at(scores: list[list[float]], cost: CostModel, total: int) -> float:
    """Expected tokens per second when the round verifies the `total` best nodes (the definition)."""
    counts = chosen_nodes(scores, total)
    return expected_tokens(scores, counts) / cost.seconds(len(scores) + sum(counts), len(scores))


def test_the_choice_is_the_best_rate_over_every_total():
    """Against the definition, total by total: the split chosen is the one, among every total allowed, whose
    expected tokens over round time is highest (the smallest such total), for random trees and costs."""
    rng = random.Random(0)
    for _ in range(40):
        scores = [sorted((math.log(rng.random()) for _ in range(rng.randrange(0, 12))), reverse=True)
                  for _ in range(rng.randrange(1, 6))]
        points = sorted(rng.sample(range(1, 60), 3))
        cost = CostModel(tuple((x, 1.0 + rng.random() * x / 10) for x in points), per_request=rng.random() / 10)
        totals = None if rng.random() < 0.5 else rng.sample(range(0, 40), 5)
        available = sum(len(s) for s in scores)
        allowed = sorted({min(t, available) for t in (range(available + 1) if totals is None else totals)})
        rates = {t: rate_at(scores, cost, t) for t in allowed}
        best = max(rates.values())
        first = next(t for t in allowed if rates[t] >= best * (1 - 1e-9))
        got = choose_nodes(scores, cost, totals)
        assert got == chosen_nodes(scores, first)
        assert rate_at(scores, cost, sum(got)) >= best * (1 - 1e-9)


def test_a_round_drafts_while_drafting_pays_and_explores_the_other_kind():
    """Measured step periods decide: a drafting round that commits 4 tokens a request in 3 ms beats a plain 1 ms
    step, one that commits 2 does not; each kind is measured once first, and every `explore` rounds the other runs
    once so neither measurement goes stale."""
    from ddtree.core.budget import RoundChoice

    choice = RoundChoice(alpha=1.0, explore=5)
    assert choice.drafts(8)  # nothing measured: draft first
    choice.observe(8, True, 3e-3, 8 * 4, verify=1e-3)
    assert not choice.drafts(8)  # then a plain round
    choice.observe(8, False, 1e-3, 8)
    kinds = [choice.drafts(8) for _ in range(10)]
    assert kinds.count(False) == 2 and kinds.count(True) == 8  # draft, exploring plain every 5th round
    assert choice.overhead_at(8) == pytest.approx(2e-3)  # the step beyond the verify's modelled time
    choice.observe(8, True, 3e-3, 8 * 2)  # now a drafting round commits only 2 tokens a request
    kinds = [choice.drafts(8) for _ in range(10)]
    assert kinds.count(True) == 2


def test_the_overhead_is_kept_by_batch_size_so_small_steps_do_not_dilute_large_ones():
    """A 64-request step's host work is many times a 4-request step's: the overhead the batch budget weighs at 64
    requests is what steps of that size measured, however many small steps a server ran in between; a size never
    measured takes the nearest measured one's."""
    from ddtree.core.budget import RoundChoice

    choice = RoundChoice(alpha=0.5)
    assert choice.overhead_at(64) == 0.0  # nothing measured yet
    choice.observe(64, True, 12e-3, 64 * 4, verify=2e-3)
    for _ in range(20):
        choice.observe(4, True, 1.5e-3, 4 * 4, verify=1e-3)
    assert choice.overhead_at(64) == pytest.approx(10e-3)
    assert choice.overhead_at(60) == pytest.approx(10e-3)  # the same bucket (57-64)
    assert choice.overhead_at(4) == pytest.approx(0.5e-3)
    assert choice.overhead_at(5) == pytest.approx(0.5e-3)  # nearest measured: 4
    assert choice.overhead_at(48) == pytest.approx(10e-3)  # nearest measured: 64
    choice.observe(64, True, 6e-3, 64 * 4, verify=2e-3)
    assert choice.overhead_at(64) == pytest.approx(7e-3)  # its own bucket's running mean


def test_batch_sizes_are_measured_in_buckets_a_quarter_of_a_power_of_two_wide():
    from ddtree.core.budget import batch_bucket

    assert [batch_bucket(n) for n in (1, 5, 8, 9, 10, 11, 16, 17, 33, 64)] == [1, 5, 8, 10, 10, 12, 16, 20, 40, 64]


def test_the_cost_model_adds_the_measured_overhead():
    cost = CostModel(((10, 1.0), (20, 3.0)), per_request=0.5, overhead=2.0)
    assert cost.seconds(15, 2) == pytest.approx(2.0 + 1.0 + 2.0)


def test_the_calibration_learns_what_the_target_accepts_of_each_forecast():
    """Nodes the drafter gives p but the target accepts with probability min(1, 2p) (an underconfident drafter):
    after enough rounds a forecast of 0.1 is worth about 0.2, one of 0.7 at most 1; bins never observed keep the
    drafter's own figure."""
    rng = np.random.default_rng(0)
    calibration = Calibration()
    for _ in range(400):
        p = rng.uniform(0.05, 0.4, size=32)
        calibration.observe(np.log(p), rng.random(32) < np.minimum(1.0, 2 * p))
    got = calibration(np.log(np.array([0.1, 0.3, 0.7, 1e-3])))
    assert abs(got[0] - 0.2) < 0.03 and abs(got[1] - 0.6) < 0.06
    assert got[2] <= 1.0 and got[3] == pytest.approx(1e-3)


def test_a_calibrated_budget_verifies_the_nodes_an_underconfident_drafter_undersells():
    """Under a cost where a node costs a tenth of a plain round, nodes the drafter gives 0.2 do not pay; once rounds
    have shown the target accepts twice what the drafter forecasts there, they do."""
    scores = scores_of([0.9, 0.6, 0.2, 0.2, 0.2], [0.8, 0.2, 0.2])
    cost = CostModel(((2, 1.0), (100, 1.0 + 98 * 0.1)))
    calibration = Calibration()
    rng = np.random.default_rng(1)
    for _ in range(400):
        p = rng.uniform(0.1, 0.3, size=32)
        calibration.observe(np.log(p), rng.random(32) < 2 * p)
    plain, calibrated = choose_nodes(scores, cost), choose_nodes(scores, cost, calibration=calibration)
    assert plain == [2, 1] and calibrated == [5, 3]
    assert choose_nodes(scores, cost, calibration=Calibration()) == plain  # nothing observed: the drafter's figures
