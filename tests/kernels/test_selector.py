"""DFlash2's selector programs (ddtree/kernels/selector.py): the one-program tree over a block's transition
model and the chain program, against the PyTorch loop, compiled on a GPU and interpreted on a CPU."""


import pytest
import torch
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_the_selector_tree_program_equals_the_pytorch_loop_on_the_gpu(budget):
    """At the published drafters' size (15 depths, 16 candidates), compiled."""
    from ddtree.kernels import selector

    gen = torch.Generator().manual_seed(budget)
    logp = torch.log_softmax(torch.randn(15, 16, 16, generator=gen) * 3, dim=-1)
    ordered, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    tokens = torch.stack([torch.randperm(151936, generator=gen)[:16] for _ in range(15)])
    want = selector.selector_prefixes(ordered, order, tokens, budget)  # CPU: the PyTorch loop
    on = [t.cuda() for t in (ordered, order, tokens)]
    got = selector._build_on_gpu(*on, selector._frontier(budget, 16, on[0].device), budget, want[0].numel())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    assert torch.equal(selector._chain_on_gpu(on[1], on[2]).cpu(), selector.selector_chain(ordered, order, tokens)[0])


@interpreted
@pytest.mark.parametrize(("depth", "k", "budget"), [(4, 3, 1), (5, 4, 9), (6, 4, 30), (4, 2, 40)])
def test_the_selector_tree_program_equals_the_pytorch_loop(depth, k, budget):
    """DFlash2's tree over its transition model: the one-program build against selector_prefixes' PyTorch loop,
    and the chain program against the chain's loop."""
    from ddtree.kernels import selector

    gen = torch.Generator().manual_seed(budget + k)
    logp = torch.log_softmax(torch.randn(depth, k, k, generator=gen) * 2, dim=-1)
    ordered, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    tokens = torch.stack([torch.randperm(90, generator=gen)[:k] for _ in range(depth)])
    want = selector.selector_prefixes(ordered, order, tokens, budget)  # on the CPU: the per-depth PyTorch loop
    kk = min(budget, k)
    got = selector._build_on_gpu(ordered, order, tokens, selector._frontier(budget, kk, logp.device), budget,
                                 want[0].numel())
    for g, w in zip(got, want, strict=True):  # tokens, parents, depths, ancestor matrix
        assert torch.equal(g, w)
    assert torch.equal(selector._chain_on_gpu(order, tokens), selector.selector_chain(ordered, order, tokens)[0])
