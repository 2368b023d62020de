"""The fp8 product of an AR step's (or a small batch's) rows with their quantization in its launch
(gemm.few_rows_fp8) against the launches it replaces and fp8.reference_mm."""

import pytest
import torch
from cases import few_rows_fp8_case
from marks import gpu, interpreted

SHAPES = [(1, 80, 512, None), (3, 64, 256, None), (1, 200, 512, (128, 128)), (5, 96, 256, (1, 128))]


@interpreted
@pytest.mark.parametrize(("rows", "n", "k", "block"), SHAPES)
def test_few_fp8_rows_equal_the_quantization_then_the_few_row_gemm(rows, n, k, block, kernels_on_cpu):
    """Channel scales with K splits (512: two 256-wide slices) and without; 128 x 128 blocks with a partial last
    block and four K splits; row-expanded block scales at five rows."""
    few_rows_fp8_case(rows, n, k, block, torch.float32, "cpu")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "n", "k", "block"), [(1, 6144, 4096, (128, 128)), (8, 4096, 12288, (128, 128)),
                                                       (1, 24576, 4096, None), (16, 4096, 12288, None)])
def test_few_fp8_rows_equal_the_quantization_then_the_few_row_gemm_on_the_gpu(rows, n, k, block, dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    few_rows_fp8_case(rows, n, k, block, dtype, "cuda")


@interpreted
def test_few_rows_refuses_what_it_does_not_take(kernels_on_cpu):
    """More than FEW_ROWS rows, rows quantized in the other scheme, a K that ends inside a scale block, gate/up rows
    of the wrong width: the caller's other kernels or the reference take them."""
    from ddtree.kernels import fp8, gemm

    gen = torch.Generator().manual_seed(0)
    block = fp8.quantize_blocks(torch.randn(64, 256, generator=gen))
    x = torch.randn(gemm.FEW_ROWS + 1, 256, generator=gen)
    assert not gemm.few_rows_take(x, block)
    assert not gemm.few_rows_take(fp8.QuantizedRows(*fp8.quantize_rows(x[:2]), torch.float32), block)
    assert not gemm.few_rows_take(x[:2, :192], fp8.quantize_blocks(torch.randn(64, 192, generator=gen)))
    assert gemm.few_rows_take(x[:2], block) and gemm.silu_fp8_linear(x[:2], block) is None
