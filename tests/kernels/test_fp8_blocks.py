"""Block-scaled fp8 weights (Qwen's published FP8 checkpoints) in the fp8 few-row GEMM, against fp8.py's float32
reference, and the reference's own blocks."""

import os
from importlib.util import find_spec

import pytest
import torch
from cases import block_scaled_case

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
interpreted = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1" or find_spec("triton") is None,
    reason="interpreted kernels run on CPU-only machines with Triton (a GPU compiles them)")


@interpreted
@pytest.mark.parametrize(("rows", "n", "k", "block_rows"), [(1, 200, 256, 128), (3, 64, 512, 128),
                                                             (5, 96, 128, 1), (70, 40, 256, 128)])
def test_the_fp8_gemm_on_block_scaled_weights_equals_the_dequantized_product(rows, n, k, block_rows, monkeypatch):
    """One row (an AR step), K splits (512), a partial last scale block (200 rows), row-expanded scales, and 70
    rows in three row tiles."""
    from ddtree.kernels import gemm

    monkeypatch.setattr(gemm, "FP8_ROW_TILE", 32)
    block_scaled_case(rows, n, k, block_rows, "cpu")


@gpu
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 4096, 4096), (32, 6144, 4096), (100, 4096, 12288)])
def test_the_fp8_gemm_on_block_scaled_weights_equals_the_dequantized_product_on_the_gpu(rows, n, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    block_scaled_case(rows, n, k, 128, "cuda")


def test_expanded_row_scales_and_row_cuts_keep_the_weight():
    from ddtree.kernels import fp8

    gen = torch.Generator().manual_seed(0)
    weight = fp8.Fp8Weight(torch.randn(200, 256, generator=gen).to(fp8.FP8), torch.rand(2, 2, generator=gen) + 0.5,
                           (128, 128))
    wide = fp8.expand_rows(weight)
    assert wide.block == (1, 128) and wide.scale.shape == (200, 2)
    assert torch.equal(fp8.dequantize(wide), fp8.dequantize(weight))
    assert torch.equal(fp8.dequantize(weight.rows(128, 200)), fp8.dequantize(weight)[128:])
    assert torch.equal(fp8.dequantize(wide.rows(3, 50)), fp8.dequantize(weight)[3:50])
    with pytest.raises(ValueError, match="scale block"):
        weight.rows(3, 50)


def test_rows_quantized_in_the_other_scheme_are_refused():
    """A block-scaled weight reads rows quantized per token per 128 columns, a channel-scaled one rows quantized per
    token: the fp8 products refuse rows quantized for the other (a silent mix would change the model's numbers)."""
    from ddtree.kernels import fp8, gemm

    gen = torch.Generator().manual_seed(0)
    block = fp8.quantize_blocks(torch.randn(64, 256, generator=gen))
    channel = fp8.quantize_weight(torch.randn(64, 256, generator=gen))
    x = torch.randn(3, 256, generator=gen)
    per_row = fp8.QuantizedRows(*fp8.quantize_rows(x), torch.float32)
    per_group = fp8.QuantizedRows(*fp8.quantize_rows(x, 128), torch.float32, 128)
    assert per_group.scale.shape == (3, 2)
    assert torch.equal(gemm.fp8_linear(x, block), gemm.fp8_linear(per_group, block))
    assert torch.equal(gemm.fp8_linear(x, channel), gemm.fp8_linear(per_row, channel))
    with pytest.raises(ValueError, match="one scale per row meet a weight that reads one per 128 columns"):
        gemm.fp8_linear(per_row, block)
    with pytest.raises(ValueError, match="one scale per 128 columns meet a weight that reads one per row"):
        gemm.fp8_linear(per_group, channel)
