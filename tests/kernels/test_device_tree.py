"""The device tree builder picks the same prefixes as the host's best-first search."""

import pytest
import torch
from ddtree.core.tree import build_tree, chain_tree, visibility
from ddtree.kernels.tree import ancestors, chain, top_prefixes


def paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Each node as its root-to-node token path (node indices differ only on score ties)."""
    out, memo = set(), {0: ()}
    for i in range(1, len(parents)):
        memo[i] = (*memo[parents[i]], tokens[i - 1])
        out.add(memo[i])
    return out


@pytest.mark.parametrize("budget", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("seed", [0, 1])
def test_same_prefix_set_and_order_as_build_tree(budget, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, 50, generator=gen) * 3
    host = build_tree(logits, budget)
    tokens, parents, depths, visible = top_prefixes(logits, budget)
    assert torch.equal(visible, visibility(host))
    parents = parents.tolist()
    assert len(parents) == host.size + 1
    assert paths(tokens.tolist(), parents) == paths(host.tokens, host.parents)
    assert tokens.tolist() == host.tokens and parents[1:] == host.parents[1:]  # best-first numbering, no ties
    assert depths.tolist() == [0, *host.depths]
    assert all(parents[i] < i for i in range(1, len(parents)))


def test_tied_scores_still_give_a_prefix_closed_tree():
    logits = torch.full((5, 20), -30.0)
    logits[:, 3] = 30.0  # every depth certain: the best paths tie with their own prefixes
    tokens, parents, depths, _ = top_prefixes(logits, 12)
    parents, depths = parents.tolist(), depths.tolist()
    assert all(parents[i] < i and depths[i] == depths[parents[i]] + 1 for i in range(1, len(parents)))
    assert tokens[:5].tolist() == [3] * 5 and depths[1:6] == [1, 2, 3, 4, 5]


def test_chain_and_ancestors_match_the_host_versions():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    host = chain_tree(logits.argmax(-1).tolist())
    tokens, parents, depths, visible = chain(logits)
    assert (tokens.tolist(), parents.tolist()[1:], depths.tolist()) == (host.tokens, host.parents[1:],
                                                                        [0, *host.depths])
    assert torch.equal(visible, visibility(host))
    for budget in (5, 40):
        tree = build_tree(logits, budget)
        _, parents, _, _ = top_prefixes(logits, budget)
        assert torch.equal(ancestors(parents, max_depth=6), visibility(tree))


def test_a_kernel_that_cannot_launch_falls_back_once_and_says_so(capsys, monkeypatch):
    from ddtree.kernels import jit

    monkeypatch.setattr(jit, "_DECLINED", set())
    calls = []

    def out_of_shared_memory(*args):
        calls.append(args)
        raise RuntimeError("out of resource: shared memory")

    key = ("tree", 15, 256, 256, torch.device("cpu"))
    assert jit.attempt(key, out_of_shared_memory, 1) is None
    assert jit.attempt(key, out_of_shared_memory, 1) is None and len(calls) == 1  # not retried
    err = capsys.readouterr().err
    assert err.count("the tree kernel cannot run at (15, 256, 256) on this GPU (RuntimeError)") == 1
    assert jit.attempt(("tree", 15, 64, 64, torch.device("cpu")), lambda: "built") == "built"  # other shapes


@pytest.mark.parametrize(("depth", "k", "budget"), [(4, 3, 1), (4, 3, 5), (6, 4, 16), (15, 16, 64), (5, 2, 40)])
@pytest.mark.parametrize("seed", [0, 1])
def test_selector_prefixes_equal_the_host_selector_tree(depth, k, budget, seed):
    """DFlash2's tree over its transition model, on the device: the host's nodes, in the host's order."""
    from ddtree.core.tree import Transitions, build_selector_tree, selector_chain
    from ddtree.kernels.selector import selector_chain as device_chain
    from ddtree.kernels.selector import selector_prefixes

    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depth, k, k, generator=gen) * 2, dim=-1)
    logp[0] = logp[0, 0]
    tokens = torch.stack([torch.randperm(100, generator=gen)[:k] for _ in range(depth)])
    host = build_selector_tree(Transitions(logp, tokens), budget)
    ordered, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    got, parents, depths, visible = selector_prefixes(ordered, order, tokens, budget)
    assert got.tolist() == host.tokens and parents.tolist()[1:] == host.parents[1:]
    assert depths.tolist() == [0, *host.depths] and torch.equal(visible, visibility(host))
    assert device_chain(ordered, order, tokens)[0].tolist() == selector_chain(Transitions(logp, tokens))
