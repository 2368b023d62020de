"""Draft quantization: the drafter's projections in float8 (e4m3), for a cheaper draft step.

At batch 1 the draft step is bound by reading the drafter's weights and the LM head rows it scores with; in
fp8 they are half the bytes (Qwen3-8B-DFlash-b16: 1.9 GB of layers in bf16). Each weight row (output channel)
has its own scale, and each input row is scaled on the fly by its own largest magnitude (per-token dynamic
scaling, vLLM's FP8-dynamic scheme), so no calibration data is needed. Products of fp8 values are exact in
float32, which accumulates them; the scales apply after the sum.

The output stays the target's own: the target verifies every drafted token and picks every emitted one. Only
the drafted trees can change, and with them the acceptance length.

On a GPU with fp8 tensor cores (compute capability 8.9 or later) the projections run as Triton kernels: the
row quantization (ddtree/fast/rows.py), then the few-row GEMM on e4m3 operands (ddtree/fast/gemm.py). Elsewhere
`reference_linear` computes the same function in float32, slowly (the CPU reference the kernels are tested
against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.errors import DDTreeError

FORMATS = ("none", "fp8")
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


def rows_of(x: torch.Tensor) -> QuantizedRows:
    """x [..., K] as QuantizedRows [M, K]: by the GPU kernel where it runs (ddtree/fast/rows.py), else the reference."""
    from ddtree.fast import gemm, rows  # here, not at import: ddtree.fast imports this module's users

    flat = x.reshape(-1, x.shape[-1])
    values, scale = rows.quantize(flat) if gemm.fp8_supported(flat) else quantize_rows(flat)
    return QuantizedRows(values, scale, x.dtype)


def reference_mm(rows: QuantizedRows, weight: Fp8Weight) -> torch.Tensor:
    """rows @ weight^T -> [M, N] in the rows' dtype: the fp8 products summed in float32, then scaled by (row scale
    x channel scale), as the GPU kernel does."""
    acc = rows.values.float() @ weight.data.float().T
    return (acc * (rows.scale[:, None] * weight.scale[None, :])).to(rows.dtype)


def reference_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ weight^T with x quantized per row: the function the fp8 kernels compute."""
    return reference_mm(QuantizedRows(*quantize_rows(x), x.dtype), weight)


def linear(x: torch.Tensor | QuantizedRows, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (or rows already quantized) @ weight^T (+ bias): the fp8 GPU kernels where they run, else the
    reference."""
    from ddtree.fast import gemm

    rows = x if isinstance(x, QuantizedRows) else rows_of(x)
    if gemm.fp8_supported(rows.values):
        out = gemm.skinny_fp8(rows.values, rows.scale, weight, rows.dtype)
    else:
        out = reference_mm(rows, weight)
    leading = x.values.shape[:-1] if isinstance(x, QuantizedRows) else x.shape[:-1]
    out = out.view(*leading, weight.shape[0])
    return out if bias is None else out + bias


class Fp8Linear(nn.Module):
    """A bias-free nn.Linear whose weight is kept only as an `Fp8Weight` (`weight`: the fp8 values, a buffer;
    `weight_scale`: the per-row scales). Quantize a module once it sits on its device in its dtype: a later
    `module.to(dtype)` would cast the fp8 buffer too."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise DDTreeError("fp8 draft quantization takes bias-free projections only")
        q = quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q.data, persistent=False)
        self.register_buffer("weight_scale", q.scale, persistent=False)
        self.bias = None

    @property
    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.fp8)


def check_format(quantization: str | None) -> str | None:
    """None for no quantization (also for "none"); the format otherwise, or a one-line error."""
    if quantization in (None, "none"):
        return None
    if quantization not in FORMATS:
        raise DDTreeError(f"draft quantization must be one of {', '.join(FORMATS)}, got {quantization!r}")
    return quantization


def check_device(device: torch.device) -> None:
    """fp8 drafts on CUDA need fp8 tensor cores; the CPU runs the float32 reference (for tests and demos)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise DDTreeError(f"fp8 draft quantization needs a GPU with fp8 tensor cores (compute capability 8.9 "
                              f"or later: Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} is "
                              f"{major}.{minor}")


def quantize_module(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by an Fp8Linear, in place (already quantized ones stay).
    Returns how many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, Fp8Linear(child))
            replaced += 1
        else:
            replaced += quantize_module(child)
    return replaced


def head_rows(weight: torch.Tensor, quantization: str | None) -> torch.Tensor | Fp8Weight:
    """The rows a draft head scores with, in the draft's format."""
    return quantize_weight(weight) if quantization == "fp8" else weight


def head_logits(hidden: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """A draft head's logits (the reference path's; the fast path's `gemm.linear` takes both formats too)."""
    return linear(hidden, weight, bias) if isinstance(weight, Fp8Weight) else F.linear(hidden, weight, bias)
