"""The one-row GEMV with its folded norm and SiLU · up against the unfused steps."""


import pytest
import torch
from cases import gemv_case
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (6144, 4096), (4096, 12288)])
@pytest.mark.parametrize("mode", ["plain", "norm", "norm_first", "silu"])
def test_one_row_gemv_equals_its_unfused_steps_on_a_gpu(dtype, n, k, mode):
    """The fused GEMV against the steps it replaces: the same input row (rounded where the reference rounds
    it), a float32 dot, one rounding at the end; the summed residual bit for bit."""
    y, want = gemv_case(n, k, mode, dtype, "cuda")
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (and rare input ties)
    assert torch.allclose(y, want, atol=tolerance, rtol=tolerance), (y - want).abs().max()


@interpreted
@pytest.mark.parametrize("mode", ["plain", "norm", "norm_first", "silu"])
def test_one_row_gemv_equals_its_unfused_steps_interpreted(mode):
    y, want = gemv_case(40, 64, mode, torch.float32, "cpu")
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-5), (y - want).abs().max()
