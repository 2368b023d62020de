"""Tree construction equals brute-force top-B prefix enumeration, and its structural invariants hold."""

import itertools
import math

import pytest
import torch
from ddtree.core.tree import (
    Transitions,
    build_selector_tree,
    build_tree,
    chain_tree,
    selector_chain,
    selector_chain_tree,
    selector_tree_from_sorted,
    top_candidates,
    visibility,
    walk,
)


def brute_force(draft_logits: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """All prefixes (as rank tuples) sorted by (score desc, rank tuple asc), first `budget` kept."""
    depth, vocab = draft_logits.shape
    k = min(budget, vocab)
    logp, _ = top_candidates(draft_logits, k)
    scored = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = 0.0
            for level, r in enumerate(ranks):
                score += logp[level][r]
            scored.append((-score, ranks))
    scored.sort()
    return [ranks for _, ranks in scored[:budget]]


def rank_tuples(tree, draft_logits: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    k = min(budget, draft_logits.shape[1])
    _, tok = top_candidates(draft_logits, k)
    out = []
    for node in range(1, tree.size + 1):
        ranks = []
        n = node
        while n:
            ranks.append(tok[tree.depths[n - 1] - 1].index(tree.tokens[n - 1]))
            n = tree.parents[n]
        out.append(tuple(reversed(ranks)))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 7, 20])
def test_tree_is_the_top_budget_prefixes_in_pop_order(seed, budget):
    torch.manual_seed(seed)
    logits = torch.randn(4, 5) * 2
    tree = build_tree(logits, budget)
    assert rank_tuples(tree, logits, budget) == brute_force(logits, budget)


@pytest.mark.parametrize("seed", range(4))
def test_tree_is_prefix_closed_with_parents_before_children(seed):
    torch.manual_seed(seed)
    logits = torch.randn(6, 50)
    tree = build_tree(logits, 64)
    assert tree.size == 64
    for node in range(1, tree.size + 1):
        parent = tree.parents[node]
        assert 0 <= parent < node
        assert tree.depths[node - 1] == (tree.depths[parent - 1] if parent else 0) + 1
        assert tree.children[parent][tree.tokens[node - 1]] == node
    siblings = [(tree.parents[n], tree.tokens[n - 1]) for n in range(1, tree.size + 1)]
    assert len(set(siblings)) == len(siblings)


def test_budget_one_per_depth_gives_the_argmax_chain_when_draft_is_confident():
    logits = torch.full((5, 10), -10.0)
    for d, t in enumerate([3, 1, 4, 1, 5]):
        logits[d, t] = 10.0
    tree = build_tree(logits, 5)
    assert tree.tokens == [3, 1, 4, 1, 5]
    assert tree.parents == [-1, 0, 1, 2, 3, 4]


def test_spine_reaches_full_depth_under_a_small_budget():
    torch.manual_seed(0)
    logits = torch.randn(8, 20) * 0.1  # flat: the plain heap spends the budget on siblings
    plain = build_tree(logits, 8)
    spine = build_tree(logits, 8, spine=True)
    assert max(plain.depths) < 8
    assert spine.depths == list(range(1, 9))
    assert spine.tokens == logits.argmax(-1).tolist()
    bigger = build_tree(logits, 20, spine=True)
    assert bigger.tokens[:8] == spine.tokens and bigger.size == 20
    for node in range(1, bigger.size + 1):
        assert bigger.parents[node] < node


def test_zero_budget_is_root_only_and_walk_gives_the_bonus():
    tree = build_tree(torch.randn(3, 4), 0)
    assert tree.size == 0
    assert walk(tree, [7]) == [0]
    assert visibility(tree).tolist() == [[True]]


def test_visibility_is_ancestors_and_self():
    tree = chain_tree([5, 6])
    tree.add(0, 9, 1)  # a sibling of node 1
    vis = visibility(tree).int().tolist()
    assert vis == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]


def test_walk_follows_matching_children_and_stops_at_the_first_miss():
    tree = chain_tree([5, 6, 7])
    tree.add(0, 9, 1)  # node 4
    assert walk(tree, [5, 6, 1, 0, 0]) == [0, 1, 2]
    assert walk(tree, [9, 0, 0, 0, 3]) == [0, 4]
    assert walk(tree, [2, 0, 0, 0, 0]) == [0]


def test_path_to_and_deepest():
    tree = chain_tree([5, 6])
    tree.add(0, 9, 1)  # node 3, a sibling of node 1
    tree.add(3, 4, 2)  # node 4: depth 2, added after node 2
    assert tree.path_to(0) == [0]
    assert tree.path_to(2) == [0, 1, 2]
    assert tree.path_to(4) == [0, 3, 4]
    assert tree.deepest() == 4
    assert build_tree(torch.randn(2, 3), 0).deepest() == 0


def random_transitions(depth: int, k: int, seed: int, scale: float = 2.0) -> Transitions:
    """A random first-order model: each depth's k distinct candidate tokens, rows of log-probabilities (depth 1's
    rows all the root's)."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depth, k, k, generator=gen) * scale, dim=-1)
    logp[0] = logp[0, 0]
    tokens = torch.stack([torch.randperm(40, generator=gen)[:k] for _ in range(depth)])
    return Transitions(logp, tokens)


def brute_force_markov(model: Transitions, budget: int) -> list[tuple[int, ...]]:
    """Every prefix as its tuple of candidate indices, scored by its transitions, best first, ties by the rank
    tuple (each candidate's rank in its parent's row)."""
    logp = model.logp.double()
    ranks = logp.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # rank of candidate j in row i
    depth, k = model.tokens.shape
    scored = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(k), repeat=d):
            prev, score, rank_tuple = 0, 0.0, []
            for level, j in enumerate(path):
                score += float(logp[level, prev, j])
                rank_tuple.append(int(ranks[level, prev, j]))
                prev = j
            scored.append((-score, tuple(rank_tuple), path))
    scored.sort()
    return [path for _, _, path in scored[:budget]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 4, 9, 30])
def test_selector_tree_is_the_top_budget_prefixes_of_the_transition_model(seed, budget):
    """A node's children are scored with its own candidate as the predecessor: the tree is the `budget` most
    probable prefixes of the first-order model (not of its marginals), in best-first order."""
    model = random_transitions(4, 3, seed)
    tree = build_selector_tree(model, budget)
    tokens = model.tokens.tolist()
    got = []
    for node in range(1, tree.size + 1):
        path = tree.path_to(node)[1:]
        got.append(tuple(tokens[tree.depths[n - 1] - 1].index(tree.tokens[n - 1]) for n in path))
    assert got == brute_force_markov(model, budget)
    assert all(0 <= tree.parents[n] < n for n in range(1, tree.size + 1))


def test_selector_chain_takes_each_depths_best_successor_of_the_previous_pick():
    model = random_transitions(5, 4, seed=9)
    chain = selector_chain(model)
    prev = 0
    for d, token in enumerate(chain):
        j = int(model.logp[d, prev].argmax())
        assert token == int(model.tokens[d, j]) and len(set(model.tokens[d].tolist())) == 4
        prev = j
    assert build_selector_tree(model, 1).tokens == chain[:1]


@pytest.mark.parametrize("seed", range(3))
def test_the_selector_chain_as_a_tree_carries_its_prefixes_transition_log_probabilities(seed):
    """A batched round's DFlash2 chain (from sorted transitions): the selector's chain, each node scored by its
    prefix's log-probability under the transitions (what the batch budget weighs); and the selector tree built
    from sorted transitions is build_selector_tree's."""
    model = random_transitions(5, 4, seed=seed)
    ordered, order = torch.sort(model.logp.double(), dim=-1, descending=True, stable=True)
    rows = ordered.tolist(), order.tolist(), model.tokens.tolist()
    chain = selector_chain_tree(*rows)
    assert chain.tokens == selector_chain(model) and chain.parents == list(range(-1, 5))
    prev, score = 0, 0.0
    for d, node_score in enumerate(chain.scores):
        j = int(model.logp[d, prev].argmax())
        score += float(model.logp[d, prev, j])
        assert node_score == pytest.approx(score, abs=1e-9)
        prev = j
    for budget in (1, 7, 20):
        assert selector_tree_from_sorted(*rows, budget).tokens == build_selector_tree(model, budget).tokens


def test_selector_tree_differs_from_the_marginal_tree_when_transitions_matter():
    """Depth 2's best candidate depends on depth 1's pick: the tree extends each depth-1 node by its own best."""
    logp = torch.full((2, 2, 2), math.log(0.05))
    logp[0, :, 0], logp[0, :, 1] = math.log(0.6), math.log(0.4)
    logp[1, 0, 1], logp[1, 1, 0] = math.log(0.95), math.log(0.95)
    logp[1, 0, 0], logp[1, 1, 1] = math.log(0.05), math.log(0.05)
    model = Transitions(logp, torch.tensor([[10, 11], [20, 21]]))
    tree = build_selector_tree(model, 4)
    assert tree.tokens == [10, 21, 11, 20] and tree.parents == [-1, 0, 1, 0, 3]  # 0.6, 0.57, 0.4, 0.38
