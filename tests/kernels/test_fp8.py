"""The fp8 kernels (row quantization, the fp8 few-row GEMM) against ddtree.kernels.fp8's float32 reference."""


import pytest
import torch
from cases import quantized_rows_case
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k", "group"), [(1, 64, None), (16, 4096, None), (16, 12288, None),
                                                  (300, 20480, None), (1, 4096, 128), (16, 12288, 128),
                                                  (300, 5120, 128), (3, 192, 128)])
def test_the_row_quantization_kernel_equals_torchs_cast_bit_for_bit(dtype, rows, k, group):
    """One scale per row, or per 128-column group (a block-FP8 checkpoint's projections; 192: a partial last
    group)."""
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels.rows import quantize as quantize_kernel

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, k, device="cuda", generator=gen) * 3).to(dtype)
    x[0, :7] = 0.0
    x[-1, :128] = 0.0  # an all-zero group
    q, scale = quantize_kernel(x, group)
    want_q, want_scale = quantize.quantize_rows(x, group)
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
@pytest.mark.parametrize(("n", "width", "group"), [(16, 4096, None), (16, 12288, None), (300, 4096, None),
                                                   (16, 4096, 128), (300, 5120, 128)])
def test_quantizing_row_kernels_equal_the_row_kernels_then_torchs_quantization(dtype, n, width, group):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    quantized_rows_case(n, width, dtype, "cuda", group)


def e4m3_grid_rows(rows: int, k: int, seed: int, group: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose values, divided by their scale, already lie on the e4m3 grid (the largest magnitude of each row,
    or of each `group` columns, 448, the scales powers of two): (rows x, their e4m3 values, their scales: [rows],
    or [rows, ceil(k / group)])."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, k), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN codes
    values = codes.view(torch.float8_e4m3fn).float()
    width = group or k
    groups = -(-k // width)
    values[:, 1::width] = 448.0 * torch.where(torch.rand(rows, groups, generator=gen) < 0.5, -1.0, 1.0)
    scales = 2.0 ** torch.randint(-12, 4, (rows, groups), generator=gen).float()
    x = values * scales.repeat_interleave(width, dim=1)[:, :k]
    return x, values, scales if group else scales[:, 0]


@interpreted
@pytest.mark.parametrize(("rows", "k", "group"), [(3, 64, None), (5, 200, None), (3, 256, 128), (5, 320, 128)])
def test_the_row_quantization_kernel_finds_each_rows_scale_and_its_e4m3_values(rows, k, group):
    """One scale per row, or per 128-column group (a block-FP8 checkpoint's projections; 320: a partial last
    group). Interpreted, on values that need no rounding: Triton's interpreter casts to e4m3 without carrying a
    rounded-up mantissa into the exponent (125.2 becomes 64, not 128), so the rounding itself is checked on the
    GPU (the GPU test above: bit for bit with torch's cast)."""
    from ddtree.kernels.fp8 import quantize_rows
    from ddtree.kernels.rows import quantize

    x, values, scales = e4m3_grid_rows(rows, k, seed=rows, group=group)
    q, scale = quantize(x, group)
    assert torch.equal(scale, scales)  # 448 x 2^e / 448
    assert torch.equal(q.float(), values)
    want_q, want_scale = quantize_rows(x, group)  # the PyTorch math (fp8.py)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@interpreted
@pytest.mark.parametrize(("n", "width", "group"), [(3, 64, None), (5, 192, None), (3, 256, 128), (5, 384, 128)])
def test_quantizing_row_kernels_equal_the_row_kernels_then_the_quantization_kernel(n, width, group):
    """Interpreted, against the interpreted kernels they fold together (which share the interpreter's e4m3 cast:
    see above); the GPU tests hold them to torch's cast too."""
    quantized_rows_case(n, width, torch.float32, "cpu", group)


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
