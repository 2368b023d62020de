"""Tree attention with one split: the split kernel normalises and writes the output itself (no merge pass), and
must agree with the merged four-split kernel and with SDPA, padded tile rows included."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TALL = dict(block_m=128, block_n=32, num_warps=8, num_stages=1)  # one tile holds all of a 65-node tree's rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "window"), [(1, None), (16, None), (65, None), (65, 24)])
@pytest.mark.parametrize("tile", [None, TALL], ids=["default", "tall"])
def test_one_split_writes_the_merged_output(dtype, n, window, tile):
    from ddtree.fast.attention import _triton_attention, launch_config, tree_attention, tree_mask

    gen = torch.Generator().manual_seed(n)
    kv_heads, groups, d, capacity, start = 2, 4, 128, 768, 560
    q = torch.randn(kv_heads, groups * n, d, generator=gen)
    cache = torch.randn(2, kv_heads, capacity, d, generator=gen)
    parents = [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=gen))) for i in range(n)]
    visible = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):  # a random tree: each row sees itself and its parent's ancestors
        visible[i] |= visible[parents[i]]
    want = tree_attention(q, cache, tree_mask(torch.tensor(start), visible, capacity, groups, d, torch.float32, window))
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
