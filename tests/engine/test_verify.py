"""One tree verify forward equals running every node's ancestor path alone; compaction equals recompute."""

import pytest
import torch
from ddtree.core.tree import build_tree
from tiny import path_tokens, prefill


@pytest.mark.parametrize("arch", ["qwen3", "llama", "moe", "swa"])
@pytest.mark.parametrize("budget", [0, 6, 40])
def test_per_node_logits_equal_each_path_alone(engines, arch, budget):
    target = engines[arch].target
    torch.manual_seed(budget)
    prefix = torch.randint(0, 90, (9,)).tolist()
    root = 11
    tree = build_tree(torch.randn(7, 96) * 3, budget)
    cache = prefill(target, prefix)
    ids = torch.tensor([root, *tree.tokens])
    positions = torch.tensor([0, *tree.depths]) + len(prefix)
    logits, taps = target.forward(ids, positions, cache, tree=tree)
    for node in range(tree.size + 1):
        alone = [*prefix, root, *path_tokens(tree, node)]
        ref_cache = target.new_cache()
        ref_logits, ref_taps = target.forward(torch.tensor(alone), torch.arange(len(alone)), ref_cache)
        torch.testing.assert_close(logits[node], ref_logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps[node], ref_taps[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "swa"])
def test_compaction_equals_recomputing_the_accepted_path(engines, arch):
    target = engines[arch].target
    torch.manual_seed(1)
    prefix = torch.randint(0, 90, (5,)).tolist()
    tree = build_tree(torch.randn(7, 96) * 3, 30)
    path = tree.path_to(tree.deepest())
    assert path != list(range(len(path))), "the test needs a path that is not the first rows"
    cache = prefill(target, prefix)
    ids = torch.tensor([3, *tree.tokens])
    positions = torch.tensor([0, *tree.depths]) + len(prefix)
    target.forward(ids, positions, cache, tree=tree)
    target.compact(cache, len(prefix), path)
    committed = [*prefix, 3, *path_tokens(tree, path[-1])]
    ref = prefill(target, committed)
    assert cache.get_seq_length() == len(committed)
    for layer, ref_layer in zip(cache.layers, ref.layers, strict=True):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-5, rtol=1e-5)
