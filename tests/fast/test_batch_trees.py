"""A batched round's trees as arrays (fast/batch_trees.py): built for every request at once, they are each request's
own tree; their ancestor matrices and the walk of the target's picks over all requests at once equal the
per-tree definitions (core/tree.py)."""

import random

import numpy as np
import pytest
import torch
from ddtree.core.tree import build_tree, visibility, walk
from ddtree.fast.batch_trees import RoundTrees, accepted_paths, dflash_trees
from ddtree.kernels.tree import top_prefixes


def random_trees(seed: int, requests: int = 6) -> RoundTrees:
    """Best-first trees of random drafts at random budgets, some empty, as one round holds them."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    trees = [build_tree(torch.randn(5, 7, generator=gen) * 2, rng.choice([0, 1, 3, 9, 20])) for _ in range(requests)]
    return RoundTrees.of(trees)


@pytest.mark.parametrize("seed", range(6))
def test_the_ancestor_matrices_of_a_round_are_each_trees_own(seed):
    """Each request's matrix, and all of them flattened and concatenated as the verify's kernels read them."""
    trees = random_trees(seed)
    each, packed = trees.visibility()
    for r, seen in enumerate(each):
        assert torch.equal(seen, visibility(trees.tree(r)))
    assert np.array_equal(packed, torch.cat([visibility(trees.tree(r)).reshape(-1) for r in range(len(each))]).numpy())


@pytest.mark.parametrize("seed", range(10))
def test_the_walk_over_every_request_at_once_is_each_trees_walk(seed):
    """Picks that follow a random branch for a random number of steps (then stray), or random picks: each request's
    accepted path is the one walking its own tree finds."""
    rng = random.Random(seed)
    trees = random_trees(seed)
    offsets, picks = [0], []
    for r in range(len(trees.sizes)):
        tree = trees.tree(r)
        own = [rng.randrange(7) for _ in range(tree.size + 1)]
        node = 0
        while tree.children[node] and rng.random() < 0.8:  # follow a branch
            token, child = rng.choice(sorted(tree.children[node].items()))
            own[node], node = token, child
        picks += own
        offsets.append(offsets[-1] + tree.size + 1)
    got = accepted_paths(trees, np.array(picks), offsets)
    for r, path in enumerate(got):
        assert path == walk(trees.tree(r), picks[offsets[r]:offsets[r + 1]])
    assert any(len(p) > 1 for p in got)  # the test walks somewhere


def test_cut_trees_keep_their_most_probable_prefixes():
    trees = random_trees(3)
    before = [trees.tree(r) for r in range(len(trees.sizes))]
    trees.cut([2] * len(trees.sizes))
    for r, tree in enumerate(before):  # a best-first tree's first nodes: their parents come before them
        assert trees.tree(r).tokens == tree.tokens[:2] and trees.tree(r).parents == tree.parents[:min(tree.size, 2) + 1]
    assert (trees.live_scores()[:, 2:] == -np.inf).all()


def test_dflash_trees_are_each_requests_tree_chain_or_cut_tree():
    """One call for a batch of ddtree (budgets 3 and 9), dflash and context-limited requests: a ddtree request's
    tree is top_prefixes' at its budget, a chain is each depth's most probable token, and a request near its
    context's end drafts only its first depths."""
    gen = torch.Generator().manual_seed(0)
    drafted = torch.randn(4, 6, 40, generator=gen) * 3
    methods, budgets, depths = ["ddtree", "dflash", "ddtree", "ddtree"], [3, 0, 9, 9], [6, 6, 6, 2]
    trees = dflash_trees(drafted, methods, budgets, depths, None)
    for r in (0, 2):
        tokens, parents, node_depths, _ = top_prefixes(drafted[r], budgets[r])
        tree = trees.tree(r)
        assert tree.tokens == tokens.tolist() and tree.parents[1:] == parents[1:].tolist()
        assert tree.depths == node_depths[1:].tolist()
    chain = trees.tree(1)
    assert chain.tokens == drafted[1].argmax(dim=-1).tolist() and chain.parents == [-1, 0, 1, 2, 3, 4, 5]
    assert chain.scores == pytest.approx(torch.log_softmax(drafted[1], -1).max(-1).values.cumsum(0).tolist())
    cut = trees.tree(3)
    assert cut.size == 9 and max(cut.depths) == 2
    assert cut.tokens == top_prefixes(drafted[3, :2], 9)[0].tolist()
