"""The fp8 kernels (row quantization, the fp8 few-row GEMM) against ddtree.kernels.fp8's float32 reference."""


import pytest
import torch
from cases import quantized_rows_case
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k"), [(1, 64), (16, 4096), (16, 12288), (300, 20480)])
def test_the_row_quantization_kernel_equals_torchs_cast_bit_for_bit(dtype, rows, k):
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels.rows import quantize as quantize_kernel

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, k, device="cuda", generator=gen) * 3).to(dtype)
    x[0, :7] = 0.0
    q, scale = quantize_kernel(x)
    want_q, want_scale = quantize.quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@gpu
@pytest.mark.parametrize(("rows", "n", "k"), [(16, 4096, 4096), (16, 2048, 4096), (16, 24576, 4096),
                                              (16, 4096, 12288), (16, 4096, 20480), (16, 16384, 4096),
                                              (3, 40, 64), (200, 10240, 4096)])
def test_the_fp8_gemm_equals_a_float64_product_of_its_operands_and_repeats_bit_for_bit(rows, n, k):
    """The draft's widths (q, k/v, gate/up, down, fc, a draft vocabulary's head; a prompt's context rows in row
    tiles). Each K tile's product is added in float32 (Hopper's fp8 MMA adds in fewer bits than float32)."""
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels import gemm

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    gen = torch.Generator(device="cuda").manual_seed(n + rows)
    weight = quantize.quantize_weight(torch.randn(n, k, device="cuda", generator=gen))
    xq, xs = quantize.quantize_rows(torch.randn(rows, k, device="cuda", generator=gen))
    want = (xq.double() @ weight.data.double().T) * (xs.double()[:, None] * weight.scale.double()[None, :])
    got = gemm.skinny_fp8(xq, xs, weight, torch.float32)
    error = ((got.double() - want).norm() / want.norm()).item()
    assert error < 5e-4, error
    assert torch.equal(gemm.skinny_fp8(xq, xs, weight, torch.float32), got)
    bf16 = gemm.skinny_fp8(xq, xs, weight, torch.bfloat16)
    assert torch.allclose(bf16.float(), got, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "width"), [(16, 4096), (16, 12288), (300, 4096)])
def test_quantizing_row_kernels_equal_the_row_kernels_then_torchs_quantization(dtype, n, width):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    quantized_rows_case(n, width, dtype, "cuda")


def e4m3_grid_rows(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose values, divided by their scale, already lie on the e4m3 grid (each row's largest magnitude
    448, the scales powers of two): (rows x, their e4m3 values, their scales)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, k), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN codes
    values = codes.view(torch.float8_e4m3fn).float()
    values[:, 1] = 448.0 * torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0)
    scales = 2.0 ** torch.randint(-12, 4, (rows,), generator=gen).float()
    return values * scales[:, None], values, scales


@interpreted
@pytest.mark.parametrize(("rows", "k"), [(3, 64), (5, 200)])
def test_the_row_quantization_kernel_finds_each_rows_scale_and_its_e4m3_values(rows, k):
    """Interpreted, on values that need no rounding: Triton's interpreter casts to e4m3 without carrying a
    rounded-up mantissa into the exponent (125.2 becomes 64, not 128), so the rounding itself is checked on the
    GPU (the GPU test above: bit for bit with torch's cast)."""
    from ddtree.kernels.rows import quantize

    x, values, scales = e4m3_grid_rows(rows, k, seed=rows)
    q, scale = quantize(x)
    assert torch.equal(scale, scales)  # 448 x 2^e / 448
    assert torch.equal(q.float(), values)


@interpreted
@pytest.mark.parametrize(("n", "width"), [(3, 64), (5, 192)])
def test_quantizing_row_kernels_equal_the_row_kernels_then_the_quantization_kernel(n, width):
    """Interpreted, against the interpreted kernels they fold together (which share the interpreter's e4m3 cast:
    see above); the GPU tests hold them to torch's cast too."""
    quantized_rows_case(n, width, torch.float32, "cpu")


@interpreted
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 64), (16, 96, 256), (5, 100, 512), (70, 48, 128)])
def test_the_fp8_gemm_equals_the_reference_on_the_same_quantized_rows(rows, n, k, monkeypatch):
    """One row tile with and without K splits (512: two 256-wide slices summed by the last program), and 70 rows
    in three tiles of 32."""
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels import gemm

    monkeypatch.setattr(gemm, "FP8_ROW_TILE", 32)
    gen = torch.Generator().manual_seed(rows + n)
    weight = quantize.quantize_weight(torch.randn(n, k, generator=gen))
    xq, xs = quantize.quantize_rows(torch.randn(rows, k, generator=gen))
    want = (xq.double() @ weight.data.double().T) * (xs.double()[:, None] * weight.scale.double()[None, :])
    got = gemm.skinny_fp8(xq, xs, weight, torch.float32)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gemm.skinny_fp8(xq, xs, weight, torch.float32), got)  # K splits summed in a fixed order
    assert not gemm._counters(xq.device, 1).any()
