"""Tree attention (ddtree/kernels/attention.py) against SDPA with the ancestor mask."""

import dataclasses

import pytest
import torch
from cases import SmallGPU, attention_case
from ddtree.kernels import jit
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "groups", "window", "d"),
                         [(1, 4, None, 64), (17, 4, None, 64), (65, 2, None, 64), (16, 4, 24, 64), (300, 1, None, 64),
                          (65, 6, None, 256)])
def test_triton_tree_attention_matches_sdpa(dtype, n, groups, window, d):
    """Head dim 256 with 390 grouped rows (a Qwen3.6-27B prompt chunk): in float32 the tuned tiles need more
    shared memory than an H200 has, so the launch must shrink them (attention.launch_fitting)."""
    from ddtree.kernels.attention import tree_attention, tree_mask

    capacity, start = 512, 150
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, window)
    cuda = [t.cuda().to(dtype) for t in (q, cache)]
    mask = tree_mask(torch.tensor(start).cuda(), visible.cuda(), capacity, groups, d, dtype, window)
    assert mask.visible is not None  # the Triton kernel, not SDPA
    got = tree_attention(*cuda, mask).float().cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (got - want).abs().max()


TALL = dict(block_m=128, block_n=32, num_warps=8, num_stages=1)  # one tile holds all of a 65-node tree's rows


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "window"), [(1, None), (16, None), (65, None), (65, 24)])
@pytest.mark.parametrize("tile", [None, TALL], ids=["default", "tall"])
def test_one_split_writes_the_merged_output(dtype, n, window, tile):
    """With one split the split kernel normalises and writes the output itself (no merge pass): it must agree
    with the merged four-split kernel and with SDPA, padded tile rows included."""
    from ddtree.kernels.attention import _triton_attention, launch_config, tree_mask

    kv_heads, groups, d, capacity, start = 2, 4, 128, 768, 560
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, window)
    q, cache = (t.cuda().to(dtype) for t in (q, cache))
    mask = tree_mask(torch.tensor(start).cuda(), visible.cuda(), capacity, groups, d, dtype, window)
    assert mask.visible is not None  # the Triton kernel, not SDPA
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    cfg = {**launch_config(groups * n, capacity, kv_heads, sms), **(tile or {})}
    direct = _triton_attention(q, cache, mask, {**cfg, "splits": 1}).float().cpu()
    merged = _triton_attention(q, cache, mask, {**cfg, "splits": 4}).float().cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(direct, merged, atol=tolerance, rtol=tolerance), (direct - merged).abs().max()
    assert torch.allclose(direct, want, atol=tolerance, rtol=tolerance), (direct - want).abs().max()


@interpreted
def test_tree_attention_on_a_gpu_with_little_shared_memory_fits_its_tiles_and_stays_right(monkeypatch):
    from ddtree.kernels import attention

    monkeypatch.setattr(jit, "_FITTED", {})
    small = SmallGPU(attention._split_kernel, {"num_stages": 1, "BLOCK_N": 16})
    monkeypatch.setattr(attention, "_split_kernel", small)
    n, groups, d, capacity, start = 7, 2, 16, 64, 20
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, None)
    mask = attention.TreeMask(torch.tensor(start), n, None, visible=visible.view(torch.int8))
    config = dict(block_m=16, block_n=64, splits=2, num_warps=4, num_stages=2, two_loops=1)
    got = attention._triton_attention(q, cache, mask, config)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert small.tried[-1] == {"num_stages": 1, "BLOCK_N": 16} and len(small.tried) == 4  # 2 stages, 64, 32, 16


@interpreted
@pytest.mark.parametrize(("n", "groups", "window"), [(1, 4, None), (7, 2, None), (7, 2, 5), (19, 1, None)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("two_loops", [0, 1, 2])
def test_tree_attention_kernel_matches_sdpa(n, groups, window, splits, two_loops):
    """Every loop form. With 3 splits of 16 keys one split holds both committed keys (up to 20) and new ones;
    in the third form the new rows' keys (up to 19, two blocks) take the last split alone, the 20 committed
    keys the other two (one split: every key in it, as the second form)."""
    from ddtree.kernels.attention import TreeMask, _triton_attention

    d, capacity, start = 16, 64, 20
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, window)
    mask = TreeMask(torch.tensor(start), n, window, visible=visible.view(torch.int8))
    config = dict(block_m=16, block_n=16, splits=splits, num_warps=4, num_stages=1, two_loops=two_loops)
    got = _triton_attention(q, cache, mask, config)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@interpreted
def test_tree_attention_takes_a_mask_that_is_a_view(kernels_on_cpu):
    """A hybrid's later prompt chunk passes its rows of the whole prompt's causal mask, a view whose rows are
    strided: the kernel must see the chunk's own causal mask, as SDPA does."""
    from ddtree.kernels.attention import tree_attention, tree_mask

    gen = torch.Generator().manual_seed(0)
    prompt, lo, heads, groups, d, capacity = 12, 7, 2, 2, 16, 32
    causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()
    chunk = causal[lo:, lo:]
    assert not chunk.is_contiguous()
    n = prompt - lo
    q, cache = torch.randn(heads, groups * n, d, generator=gen), torch.randn(2, heads, capacity, d, generator=gen)
    mask = tree_mask(torch.tensor(lo), chunk, capacity, groups, d, torch.float32)
    assert mask.visible is not None  # the Triton kernel's form (SDPA's additive mask handles views by itself)
    got = tree_attention(q, cache, mask)
    columns = torch.arange(capacity)
    allowed = (columns[None, :] <= lo + torch.arange(n)[:, None]).repeat(groups, 1)  # the chunk's causal rule
    want = torch.nn.functional.scaled_dot_product_attention(q[None], cache[0][None], cache[1][None],
                                                            attn_mask=allowed[None, None])[0]
    want = want.view(heads, groups, n, d).permute(2, 0, 1, 3).reshape(n, -1)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "groups"), [(16, 4), (1, 4), (65, 2)])
def test_tree_attention_with_sinks_matches_the_reference_on_the_gpu(dtype, n, groups):
    from ddtree.kernels.attention import tree_attention, tree_mask

    capacity, start, d = 512, 150, 64
    q, cache, visible, _ = attention_case(n, groups, d, capacity, start, None)
    sinks = torch.randn(2 * groups, generator=torch.Generator().manual_seed(n)) * 3
    want = tree_attention(q, cache, dataclasses.replace(
        tree_mask(torch.tensor(start), visible, capacity, groups, d, torch.float32), sinks=sinks))
    mask = tree_mask(torch.tensor(start).cuda(), visible.cuda(), capacity, groups, d, dtype)
    got = tree_attention(q.cuda().to(dtype), cache.cuda().to(dtype), dataclasses.replace(mask, sinks=sinks.cuda()))
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float().cpu(), want, atol=tolerance, rtol=tolerance)


@interpreted
@pytest.mark.parametrize(("n", "groups", "splits", "two_loops"), [(8, 2, 1, 0), (8, 2, 3, 1), (8, 1, 3, 2),
                                                                  (1, 4, 2, 0)])
def test_tree_attention_kernel_with_sinks_matches_the_reference(n, groups, splits, two_loops):
    """A drafter's per-head sink logits join each softmax: in the split kernel's own output (one split) or in the
    merge (several), as in the CPU reference's extra column."""
    import dataclasses

    from ddtree.kernels.attention import TreeMask, _triton_attention, tree_attention, tree_mask

    d, capacity, start = 16, 64, 20
    gen = torch.Generator().manual_seed(n + splits)
    q, cache = torch.randn(2, groups * n, d, generator=gen), torch.randn(2, 2, capacity, d, generator=gen)
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    sinks = torch.randn(2 * groups, generator=gen) * 3
    plain = tree_mask(torch.tensor(start), visible, capacity, groups, d, torch.float32)
    want = tree_attention(q, cache, dataclasses.replace(plain, sinks=sinks))
    assert not torch.allclose(want, tree_attention(q, cache, plain), atol=1e-3)  # the sinks matter here
    mask = TreeMask(torch.tensor(start), n, None, visible=visible.view(torch.int8), sinks=sinks)
    config = dict(block_m=16, block_n=16, splits=splits, num_warps=4, num_stages=1, two_loops=two_loops)
    got = _triton_attention(q, cache, mask, config)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
