"""Hybrid targets (Gated DeltaNet + attention): tree-aware verification is exact in float32."""

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.core.tree import build_tree, chain_tree
from ddtree.engine import Engine
from ddtree.models.hybrid import TreeGDN
from tiny import make_draft, make_hybrid_target, path_tokens, prefill
from transformers import AutoModelForCausalLM

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    make_draft(root / "draft", taps=[1, 2])
    out = {}
    for seed, arch in enumerate(ARCHS):
        make_hybrid_target(root / arch, arch, seed=seed)
        out[arch] = (root / arch, Engine.from_pretrained(root / arch, root / "draft", device="cpu"))
    return out


def states(cache):
    return {k: v.clone() for k, v in cache.conv.items()}, {k: v.clone() for k, v in cache.recurrent.items()}


def assert_states_equal(a, b, atol=1e-4):
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], atol=atol, rtol=atol)


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_checkpoints_load_text_only(hybrid, arch):
    engine = hybrid[arch][1]
    assert type(engine.target).__name__ == "HybridTarget"
    assert len(engine.target.gdn.layers) == 3 and engine.target.gdn.kernels.name == "torch"


@pytest.mark.parametrize("arch", ARCHS)
def test_per_node_logits_equal_each_path_alone_and_committed_state_is_untouched(hybrid, arch):
    target = hybrid[arch][1].target
    torch.manual_seed(0)
    prefix = torch.randint(0, 90, (7,)).tolist()
    tree = build_tree(torch.randn(7, 96) * 3, 24)
    cache = prefill(target, prefix)
    before = states(cache)
    ids = torch.tensor([13, *tree.tokens])
    positions = torch.tensor([0, *tree.depths]) + len(prefix)
    logits, _ = target.forward(ids, positions, cache, tree=tree)
    assert_states_equal(states(cache), before, atol=0)
    for node in range(tree.size + 1):
        alone = [*prefix, 13, *path_tokens(tree, node)]
        ref_logits, _ = target.forward(torch.tensor(alone), torch.arange(len(alone)), target.new_cache())
        # float32; the chunked (prompt) and recurrent (tree) kernels sum in different orders
        torch.testing.assert_close(logits[node], ref_logits[-1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_state_after_commit_equals_running_the_committed_tokens_one_by_one(hybrid, arch):
    target = hybrid[arch][1].target
    torch.manual_seed(1)
    prefix = torch.randint(0, 90, (6,)).tolist()
    tree = build_tree(torch.randn(7, 96) * 3, 20)
    path = tree.path_to(tree.deepest())
    cache = prefill(target, prefix)
    ids = torch.tensor([13, *tree.tokens])
    target.forward(ids, torch.tensor([0, *tree.depths]) + len(prefix), cache, tree=tree)
    target.compact(cache, len(prefix), path)
    committed = [*prefix, 13, *path_tokens(tree, path[-1])]
    one_by_one = target.new_cache()
    for pos, token in enumerate(committed):
        target.forward(torch.tensor([token]), torch.tensor([pos]), one_by_one)
    assert_states_equal(states(cache), states(one_by_one))
    assert cache.get_seq_length() == one_by_one.get_seq_length() == len(committed)
    for layer, ref in zip(cache.kv.layers, one_by_one.kv.layers, strict=True):
        if layer.keys is not None and layer.keys.numel():
            torch.testing.assert_close(layer.keys, ref.keys, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chain_verify_matches_stock_single_token_decoding(hybrid, arch):
    """Guard against transformers' multi-token cached GDN forward (which may restart the recurrence):
    our multi-token verify must equal the stock model decoding one token at a time."""
    path, engine = hybrid[arch]
    stock = AutoModelForCausalLM.from_pretrained(path)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        out = stock(torch.tensor([tokens[:4]]), use_cache=True)
        cache, stepwise = out.past_key_values, []
        for t in tokens[4:]:
            out = stock(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            stepwise.append(out.logits[0, -1])
    target = engine.target
    ours_cache = prefill(target, tokens[:4])
    chain = chain_tree(tokens[5:])
    logits, _ = target.forward(torch.tensor(tokens[4:]), torch.arange(4, 8), ours_cache, tree=chain)
    torch.testing.assert_close(logits, torch.stack(stepwise), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ddtree_and_dflash_equal_ar_and_transformers(hybrid, arch):
    path, engine = hybrid[arch]
    stock = AutoModelForCausalLM.from_pretrained(path)
    stock.generation_config.eos_token_id = None
    for prompt in ([1, 2, 3, 4, 5], [42], [7, 7, 7, 8, 9, 10, 11, 12, 13]):
        ar = engine.generate(prompt, GREEDY, method="ar").token_ids
        hf = stock.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False)
        assert ar == hf[0, len(prompt):].tolist()
        assert engine.generate(prompt, GREEDY, method="dflash").token_ids == ar
        for budget in (4, 32):
            assert engine.generate(prompt, GREEDY, method="ddtree", budget=budget).token_ids == ar


def test_commit_installs_the_last_accepted_nodes_state(hybrid):
    target = hybrid["qwen3_5"][1].target
    cache = prefill(target, [1, 2, 3])
    tree = build_tree(torch.randn(3, 96) * 3, 6)
    target.forward(torch.tensor([5, *tree.tokens]), torch.tensor([0, *tree.depths]) + 3, cache, tree=tree)
    layer = next(iter(cache.node_conv))
    expected = cache.node_recurrent[layer][4].clone()
    TreeGDN.commit(cache, 4)
    torch.testing.assert_close(cache.recurrent[layer][0], expected)
    assert not cache.node_conv and not cache.node_recurrent
