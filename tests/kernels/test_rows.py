"""The multi-row norm and SiLU · up kernels against the reference functions."""


import pytest
import torch
from cases import rows_case
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "width"), [(16, 4096), (65, 4096), (65, 5120), (129, 12288)])
def test_row_kernels_equal_the_reference_norms_and_silu_on_a_gpu(dtype, n, width):
    rows_case(n, width, dtype, "cuda")


@interpreted
@pytest.mark.parametrize("width", [64, 80])  # 80: a width that is not a power of two (masked columns)
def test_row_kernels_equal_the_reference_norms_and_silu_interpreted(width):
    """The row kernels against the reference's functions in float32. Triton's interpreter truncates float32 to
    bfloat16 where a GPU rounds to nearest, so the GPU tests check the kernels' bfloat16 rounding."""
    rows_case(5, width, torch.float32, "cpu")
