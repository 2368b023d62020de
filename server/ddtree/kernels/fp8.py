"""The fp8 (e4m3) weight and row formats of quantized projections, and their float32 reference.

Each weight row (output channel) has its own scale, and each input row is scaled on the fly by its own largest
magnitude (per-token dynamic scaling, vLLM's FP8-dynamic scheme). Products of fp8 values are exact in float32,
which accumulates them; the scales apply after the sum. The GPU kernels (rows.py, gemm.py) compute exactly the
functions defined here; this module is what they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
TINY = 1e-12  # the scale floor of an all-zero row
WEIGHT_BLOCK = 8192  # weight rows quantized at a time (float32 scratch: 8192 x K x 4 bytes)


@dataclass(frozen=True)
class Fp8Weight:
    """A weight [N, K] as fp8 values `data` and one float32 scale per output row: weight ≈ data * scale[:, None]."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """Each row scaled so that its largest magnitude is e4m3's largest value, then rounded to nearest (even). In
    blocks of rows, so that a large LM head needs little float32 scratch memory."""
    rows = weight.shape[0]
    data = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(rows, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, WEIGHT_BLOCK):
        data[start:start + WEIGHT_BLOCK], scale[start:start + WEIGHT_BLOCK] = quantize_rows(
            weight.detach()[start:start + WEIGHT_BLOCK])
    return Fp8Weight(data, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M, K] as fp8 values and per-row float32 scales [M] (the reference for the GPU kernel): scale =
    largest magnitude x float32(1 / FP8_MAX), each value / scale rounded to nearest even (a division of two
    tensors, correctly rounded on every device: torch divides by a scalar as a product with its reciprocal on
    CUDA, and the kernel must give the same bits)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp(min=TINY) * (1.0 / FP8_MAX)
    return (xf / scale[:, None]).to(FP8), scale


@dataclass(frozen=True)
class QuantizedRows:
    """Rows [M, K] quantized once for several projections that read them (a draft layer's q and k/v): fp8
    `values`, per-row `scale`s, and the `dtype` of the rows they stand for (the products')."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def reference_mm(rows: QuantizedRows, weight: Fp8Weight) -> torch.Tensor:
    """rows @ weight^T -> [M, N] in the rows' dtype: the fp8 products summed in float32, then scaled by (row scale
    x channel scale), as the GPU kernel does."""
    acc = rows.values.float() @ weight.data.float().T
    return (acc * (rows.scale[:, None] * weight.scale[None, :])).to(rows.dtype)


def reference_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ weight^T with x quantized per row: the function the fp8 kernels compute."""
    return reference_mm(QuantizedRows(*quantize_rows(x), x.dtype), weight)
