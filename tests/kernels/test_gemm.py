"""The projections' kernels (ddtree/kernels/gemm.py): the few-row GEMM, paired projections, and the routes
`linear` takes (GEMV, skinny GEMM, cuBLASLt) giving F.linear's product."""


import pytest
import torch
from cases import SmallGPU, paired_projection_case
from ddtree.kernels import jit
from ddtree.switches import override
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_a_draft_layers_q_and_kv_in_one_launch_equal_their_own_products(fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    paired_projection_case(16, 4096, 2048, 4096, fp8, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(2, 40, 64), (16, 4096, 4096), (17, 6144, 4096), (32, 4100, 12288),
                                              (15, 151936, 256), (65, 1000, 256)])
def test_skinny_gemm_equals_a_float64_product_and_repeats_bit_for_bit(dtype, rows, n, k):
    """The few-row GEMM (split-K partials summed by the last program of each column tile) against float64;
    two launches give the same bits (the arrival counters reset); `linear` takes it only up to MAX_ROWS."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm

    gen = torch.Generator().manual_seed(rows + n + k)
    weight = (torch.randn(n, k, generator=gen) / 32).to(dtype).cuda()
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype).cuda()
    want = F.linear(x.double(), weight.double())
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    y = gemm.skinny_linear(x, weight)
    assert y.dtype == dtype and torch.allclose(y.double(), want, atol=tolerance, rtol=tolerance)
    assert torch.equal(gemm.skinny_linear(x, weight), y)
    if k % 256 == 0:  # the split-K reduction, forced
        split = dict(block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=3)
        assert torch.allclose(gemm.skinny_linear(x, weight, split).double(), want, atol=tolerance, rtol=tolerance)
    assert gemm.supported(x, weight) == (rows <= gemm.MAX_ROWS)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [33, 65, 128, 129])
def test_many_row_projections_go_through_cublaslt_and_equal_a_float64_product(monkeypatch, dtype, rows):
    """Without the wgmma kernel (not Hopper, or DDTREE_WGMMA=0), `linear` hands half-precision rows past the skinny
    kernel's, up to LT_MAX_ROWS, to cuBLASLt by way of a zero bias, and the product stays right; float32 and
    wider trees keep cuBLAS."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm

    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(6144, 4096, generator=gen) / 32).to(dtype).cuda()
    x = (torch.randn(rows, 4096, generator=gen) * 3).to(dtype).cuda()
    biases = []
    monkeypatch.setattr(gemm, "_zero_bias", lambda n, x: biases.append(n) or torch.zeros(n, dtype=x.dtype,
                                                                                          device=x.device))
    with override(wgmma=False):
        y = gemm.linear(x, weight)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), F.linear(x.double(), weight.double()), atol=tolerance, rtol=tolerance)
    assert biases == ([6144] if dtype == torch.bfloat16 and rows <= gemm.LT_MAX_ROWS else [])


@interpreted
@pytest.mark.parametrize(("rows", "n", "k", "split_k"), [(2, 40, 64, 1), (17, 96, 256, 1), (5, 100, 512, 4),
                                                         (33, 70, 128, 2)])
def test_skinny_gemm_equals_a_float64_product_and_resets_its_counters(rows, n, k, split_k):
    from ddtree.kernels import gemm

    gen = torch.Generator().manual_seed(rows * n)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    config = dict(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    y = gemm.skinny_linear(x, weight, config)
    assert torch.allclose(y.double(), x.double() @ weight.double().T, atol=1e-4, rtol=1e-4)
    assert torch.equal(gemm.skinny_linear(x, weight, config), y)  # the last arrival sums in a fixed order
    assert not gemm._counters(x.device, 1).any()  # ... and leaves every counter at zero


@interpreted
def test_few_row_gemm_on_a_gpu_with_little_shared_memory_fits_its_tiles_and_stays_right(monkeypatch):
    from ddtree.kernels import gemm

    monkeypatch.setattr(jit, "_FITTED", {})
    small = SmallGPU(gemm._skinny_kernel, {"num_stages": 1, "BLOCK_K": 64})
    monkeypatch.setattr(gemm, "_skinny_kernel", small)
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(5, 512, generator=gen), torch.randn(40, 512, generator=gen)
    config = dict(block_n=32, block_k=128, split_k=2, num_warps=4, num_stages=2)
    y = gemm.skinny_linear(x, weight, config)
    assert torch.allclose(y.double(), x.double() @ weight.double().T, atol=1e-4, rtol=1e-4)
    assert small.tried == [{"num_stages": 2, "BLOCK_K": 128}, {"num_stages": 1, "BLOCK_K": 128},
                           {"num_stages": 1, "BLOCK_K": 64}]


@interpreted
def test_linear_takes_the_gemv_for_one_row_of_a_narrow_weight(kernels_on_cpu, monkeypatch):
    """One row of a weight up to ROW_GEMV_MAX_N wide goes through the GEMV (wider ones keep F.linear); either way
    the product is F.linear's."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm
    from ddtree.kernels.gemv import gemv

    calls = []
    monkeypatch.setattr(gemm, "gemv", lambda x, weight: calls.append(weight.shape[0]) or gemv(x, weight))
    monkeypatch.setattr(gemm, "ROW_GEMV_MAX_N", 48)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=gen)
    for n, routed in ((40, True), (56, False)):
        weight = torch.randn(n, 64, generator=gen)
        assert torch.allclose(gemm.linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
        assert (calls[-1:] == [n]) == routed
    assert calls == [40]


@interpreted
@pytest.mark.parametrize(("rows", "n2", "fp8"), [(5, 40, False), (16, 128, False), (5, 40, True)])
def test_paired_projections_equal_their_own_products(kernels_on_cpu, rows, n2, fp8):
    """The second weight's rows fill the columns after the first's 64: a ragged last tile, K split or not."""
    paired_projection_case(rows, 64, n2, 256, fp8, "cpu")
