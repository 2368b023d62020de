"""The tree step's kernels: vocabulary argmax and top-k, and the one-program best-first tree build."""


import pytest
import torch
from cases import argmax_case, distinct_logits, sample_case
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(5, 151936), (65, 151936), (129, 151936), (16, 16384), (5, 4097)])
def test_the_argmax_kernels_equal_torchs_argmax_on_a_gpu(dtype, rows, vocab):
    argmax_case(rows, vocab, dtype, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(20000, 4097), (2000, 151936)])
def test_the_sampling_kernels_pick_the_argmax_at_temperature_0_and_sample_the_softmax_above_it_on_a_gpu(dtype, rows,
                                                                                                      vocab):
    sample_case(rows, vocab, dtype, "cuda")


@gpu
@pytest.mark.parametrize("budget", [1, 3, 16, 64, 128, 200])
@pytest.mark.parametrize("vocab", [50, 8192])
def test_the_one_kernel_tree_build_equals_the_pytorch_loop(budget, vocab):
    from ddtree.kernels.tree import top_prefixes

    logits = distinct_logits(15, vocab, seed=budget)
    want = top_prefixes(logits, budget)  # CPU: torch.topk and the per-depth PyTorch loop
    got = top_prefixes(logits.cuda(), budget)  # CUDA: the vocabulary kernels and the tree kernel
    for g, w in zip(got, want, strict=True):  # tokens, parents, depths, ancestor matrix
        assert torch.equal(g.cpu(), w)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "k"), [(20, 2), (8192, 64), (151936, 16), (151936, 128), (5000, 300)])
def test_vocab_top_kernels_equal_topk_and_logsumexp_on_a_gpu(dtype, vocab, k):
    from ddtree.kernels.tree import vocab_top

    logits = distinct_logits(15, vocab, seed=k).to(dtype)
    logp, tokens = vocab_top(logits.cuda(), k)
    wide = logits.float()
    top, want_tokens = wide.topk(k, dim=-1)
    want = top - wide.logsumexp(dim=-1, keepdim=True)
    if dtype == torch.bfloat16:  # rounding makes ties: among equal logits the lower token comes first
        want_tokens = wide.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(tokens.cpu(), want_tokens)
    assert torch.allclose(logp.cpu(), want, atol=1e-5, rtol=1e-6)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "chunk"), [(300, 64), (200, 128)])
def test_the_argmax_kernels_equal_torchs_argmax_interpreted(dtype, vocab, chunk):
    argmax_case(5, vocab, dtype, "cpu", chunk)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampling_kernels_pick_the_argmax_at_temperature_0_and_sample_the_softmax_above_it_interpreted(dtype):
    sample_case(400, 12, dtype, "cpu", chunk=8)


@interpreted
@pytest.mark.parametrize(("vocab", "k", "dtype"), [(20, 2, torch.float32), (300, 16, torch.float32),
                                                   (2500, 40, torch.float32), (20, 2, torch.bfloat16),
                                                   (2500, 40, torch.bfloat16)])
def test_vocab_top_kernels_equal_topk_and_logsumexp_interpreted(vocab, k, dtype):
    """bf16 logits take the kernel's int32 keys; among tied logits the lower token comes first. 2500 logits
    make three chunks at k = 40 (interpreted, each chunk's bitonic top-k takes seconds)."""
    from ddtree.kernels.tree import _vocab_top_on_gpu

    logits = distinct_logits(4, vocab, seed=k)
    if dtype == torch.bfloat16:
        # 7 values: every top-k crosses ties, within chunks and between them (+ 0.0: no -0.0, which the keys
        # order below +0.0 where a stable sort sees a tie)
        logits = logits.div(2).round() + 0.0
    logits = logits.to(dtype)
    logp, tokens = _vocab_top_on_gpu(logits, k)
    wide = logits.float()
    top, want_tokens = wide.topk(k, dim=-1)
    if dtype == torch.bfloat16:
        want_tokens = wide.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(tokens, want_tokens)
    assert torch.allclose(logp, top - wide.logsumexp(dim=-1, keepdim=True), atol=1e-5, rtol=1e-6)


@interpreted
@pytest.mark.parametrize(("vocab", "k"), [(20, 2), (300, 16)])
def test_vocab_top_kernels_map_a_draft_vocabularys_columns_to_token_ids(vocab, k):
    """A draft vocabulary's column c is token token_ids[c]: the merge kernel writes the ids, as the CPU path does."""
    from ddtree.kernels.tree import _vocab_top_on_gpu, vocab_top

    logits = distinct_logits(3, vocab, seed=vocab)
    token_ids = torch.randperm(5 * vocab, generator=torch.Generator().manual_seed(k))[:vocab]
    logp, tokens = _vocab_top_on_gpu(logits, k, token_ids)
    want_logp, want_tokens = vocab_top(logits, k, token_ids)  # the CPU path: torch.topk, then the ids
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(tokens, token_ids[_vocab_top_on_gpu(logits, k)[1]])
    assert torch.allclose(logp, want_logp, atol=1e-5, rtol=1e-6)


@interpreted
@pytest.mark.parametrize(("budget", "vocab"), [(1, 50), (5, 50), (16, 50), (24, 300)])
def test_the_one_program_tree_build_equals_the_pytorch_loop(budget, vocab):
    from ddtree.kernels.tree import _build_on_gpu, _frontier, top_prefixes, tree_size, vocab_top

    logits = distinct_logits(5, vocab, seed=budget)
    want = top_prefixes(logits, budget)  # on the CPU: the per-depth PyTorch loop
    k = min(budget, vocab)
    logp, tokens = vocab_top(logits, k)
    got = _build_on_gpu(logp, tokens, _frontier(budget, k, logits.device), budget, tree_size(5, vocab, budget))
    for g, w in zip(got, want, strict=True):  # tokens, parents, depths, ancestor matrix
        assert torch.equal(g, w)


def batch_case(blocks: int, depth: int, vocab: int, budget: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Draft blocks' vocabulary top-k, the last block allowed only its first 2 depths (-inf past them), as a block
    near the end of its context is."""
    from ddtree.kernels.tree import vocab_top

    logits = distinct_logits(blocks * depth, vocab, seed=seed)
    logp, tokens = vocab_top(logits, min(budget, vocab))
    logp, tokens = logp.view(blocks, depth, -1).clone(), tokens.view(blocks, depth, -1)
    logp[-1, 2:] = float("-inf")
    return logits.view(blocks, depth, vocab), logp, tokens


@pytest.mark.parametrize(("budget", "vocab"), [(1, 50), (5, 50), (16, 50), (32, 300)])
def test_a_batch_of_trees_is_each_blocks_own_tree(budget, vocab):
    """Each block of a batch gets the tree top_prefixes builds for it alone, its node scores are the log-probability
    of each node's whole prefix, and a block cut to two depths keeps exactly its prefixes of depth <= 2."""
    from ddtree.kernels.tree import batch_prefixes, top_prefixes

    logits, logp, tokens = batch_case(3, 5, vocab, budget, seed=budget)
    got_tokens, parents, depths, scores = batch_prefixes(logp, tokens, budget)
    for b in range(2):
        want = top_prefixes(logits[b], budget)
        assert torch.equal(got_tokens[b], want[0]) and torch.equal(parents[b], want[1])
        assert torch.equal(depths[b], want[2])
    full = torch.log_softmax(logits.float(), dim=-1)
    for b in range(3):
        for node in range(1, got_tokens.shape[1] + 1):
            if scores[b, node - 1] == float("-inf"):
                continue
            path, total = node, 0.0
            while path:
                total += full[b, depths[b, path] - 1, got_tokens[b, path - 1]].item()
                path = parents[b, path].item()
            assert scores[b, node - 1].item() == pytest.approx(total, abs=1e-4)
    finite = scores[2] > float("-inf")
    kept = int(finite.sum())
    assert finite[:kept].all() and not finite[kept:].any()  # the cut block's real nodes come first
    assert kept == min(budget, sum(min(budget, min(budget, vocab) ** d) for d in (1, 2)))
    assert int(depths[2, 1:kept + 1].max()) <= 2


@interpreted
@pytest.mark.parametrize(("budget", "vocab"), [(3, 50), (16, 50)])
def test_the_batched_tree_kernel_equals_the_pytorch_loop_interpreted(budget, vocab):
    from ddtree.kernels.tree import _build_batch_on_gpu, _build_torch, _frontier, tree_size

    _, logp, tokens = batch_case(3, 4, vocab, budget, seed=budget + 1)
    n = tree_size(4, logp.shape[-1], budget)
    pairs = _frontier(budget, logp.shape[-1], logp.device)
    got = _build_batch_on_gpu(logp, tokens, pairs, budget, n)
    want = _build_torch(logp, tokens, pairs, budget, n)
    finite = want[3] > float("-inf")
    assert torch.equal(got[4] > float("-inf"), finite)
    for g, w in zip((got[0], got[1][:, 1:], got[2][:, 1:]), want[:3], strict=True):
        w = w[:, 1:] if w.shape[1] > finite.shape[1] else w
        assert torch.equal(g[finite], w[finite])
    assert torch.equal(got[4][finite], want[3][finite])


@gpu
@pytest.mark.parametrize("budget", [1, 16, 32, 64])
def test_the_batched_tree_kernel_equals_the_pytorch_loop_on_a_gpu(budget):
    from ddtree.kernels.tree import batch_prefixes

    _, logp, tokens = batch_case(8, 15, 8192, budget, seed=budget)
    want = batch_prefixes(logp, tokens, budget)  # CPU: the PyTorch loop
    got = batch_prefixes(logp.cuda(), tokens.cuda(), budget)
    finite = want[3] > float("-inf")
    assert torch.equal(got[3].cpu() > float("-inf"), finite)
    for g, w in zip((got[0], got[1][:, 1:], got[2][:, 1:], got[3]), (want[0], want[1][:, 1:], want[2][:, 1:], want[3]),
                    strict=True):
        assert torch.equal(g.cpu()[finite], w[finite])
