"""The attention-heads kernel (q/k norms, RoPE, the K/V cache write) against the reference step."""


import pytest
import torch
from ddtree.kernels.heads import attention_heads as heads_kernel
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "heads", "kv_heads", "d", "norm"),
                         [(1, 32, 8, 128, True), (65, 32, 8, 128, True), (16, 4, 2, 64, False), (3, 2, 2, 16, True)])
def test_attention_heads_kernel_equals_the_reference_step_on_a_gpu(dtype, n, heads, kv_heads, d, norm):
    """The one-kernel heads step against layers.attention_heads run eagerly: grouped queries, the cache rows
    at `slots` (v bit for bit), and no other cache row touched; q/k/v as row-strided views of one qkv."""
    from ddtree.fast.layers import attention_heads

    gen = torch.Generator().manual_seed(n * d)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype).cuda()
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_norm, k_norm = ((torch.rand(d, generator=gen) + 0.5).to(dtype).cuda() if norm else None for _ in range(2))
    angles = torch.randn(n, d // 2, generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype).cuda() for f in (torch.cos, torch.sin))
    slots = torch.randperm(100, generator=gen)[:n].cuda()
    want_cache = torch.randn(2, kv_heads, 100, d, generator=gen).to(dtype).cuda()
    got_cache = want_cache.clone()
    want = attention_heads(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, want_cache, slots)
    got = heads_kernel(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, got_cache, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the reference rounds after every op
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.allclose(got_cache.float(), want_cache.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got_cache[1], want_cache[1])


@interpreted
@pytest.mark.parametrize("block_t", [1, 2, 4])  # 1: a GPU's programs; 2: a partial last block; 4: the CPU's
@pytest.mark.parametrize("norm", [True, False])
def test_attention_heads_kernel_equals_the_reference_step_interpreted(norm, block_t, monkeypatch):
    from ddtree.fast.layers import attention_heads
    from ddtree.kernels import heads as heads_module
    from ddtree.kernels.heads import attention_heads as heads_kernel

    monkeypatch.setattr(heads_module, "launch_rows", lambda n, device: block_t)

    n, heads, kv_heads, d = 3, 4, 2, 16
    gen = torch.Generator().manual_seed(n * d)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_norm, k_norm = (torch.rand(d, generator=gen) + 0.5 if norm else None for _ in range(2))
    angles = torch.randn(n, d // 2, generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    slots = torch.tensor([7, 2, 11])
    want_cache = torch.randn(2, kv_heads, 16, d, generator=gen)
    got_cache = want_cache.clone()
    want = attention_heads(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, want_cache, slots)
    got = heads_kernel(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, got_cache, slots)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got_cache, want_cache, atol=1e-5, rtol=1e-5) and torch.equal(got_cache[1], want_cache[1])
