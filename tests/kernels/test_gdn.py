"""The Gated DeltaNet row and tree kernels against the PyTorch steps."""


import pytest
import torch
from cases import gdn_case
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "k_heads", "d"), [(4, 2, 16), (48, 16, 128)])
@pytest.mark.parametrize("nodes", [1, 17, 33, 65, 128])
def test_gated_deltanet_kernels_equal_the_pytorch_steps_on_a_gpu(dtype, heads, k_heads, d, nodes):
    """Qwen3.6-27B's widths (48 value heads over 16 key heads, d 128) and a tiny grouped case, for an AR step
    and trees up to TREE_MAX nodes: the kernels' outputs and commit record against the steps they replace.
    bf16: within the conv's and the norm's rounding."""
    got, want = gdn_case(heads, k_heads, d, dtype, "cuda", nodes)
    assert torch.equal(got[1], want[1])  # the conv window's columns, copied
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for name, g, w in zip(("out", "keys", "u", "decay"), got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert torch.allclose(g.float(), w.float(), atol=tolerance, rtol=tolerance), (name, (g.float() - w).abs().max())


@interpreted
@pytest.mark.parametrize(("heads", "k_heads", "d"), [(4, 2, 16), (2, 2, 16), (2, 1, 64)])
@pytest.mark.parametrize("nodes", [1, 2, 9, 24])
def test_gated_deltanet_kernels_equal_the_pytorch_steps_interpreted(heads, k_heads, d, nodes, monkeypatch):
    from ddtree.kernels import gdn

    monkeypatch.setattr(gdn, "TREE_SLICE", 32)  # at d 64: two d_v slices
    monkeypatch.setattr(gdn, "TREE_CONFIGS", dict.fromkeys(gdn.TREE_CONFIGS, (4, 16)))  # 24 nodes: two row tiles
    got, want = gdn_case(heads, k_heads, d, torch.float32, "cpu", nodes)
    assert torch.equal(got[1], want[1])  # the conv window's columns, copied
    for name, g, w in zip(("out", "keys", "u", "decay"), got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), (name, (g - w).abs().max())
