"""Draft quantization: the drafter's projections in float8 (e4m3), for a cheaper draft step.

At batch 1 the draft step is bound by reading the drafter's weights and the LM head rows it scores with; in
fp8 they are half the bytes (Qwen3-8B-DFlash-b16: 1.9 GB of layers in bf16). Each weight row (output channel)
has its own scale, and each input row is scaled on the fly by its own largest magnitude (per-token dynamic
scaling, vLLM's FP8-dynamic scheme), so no calibration data is needed. Products of fp8 values are exact in
float32, which accumulates them; the scales apply after the sum.

The output stays the target's own: the target verifies every drafted token and picks every emitted one. Only
the drafted trees can change, and with them the acceptance length.

On a GPU with fp8 tensor cores (compute capability 8.9 or later) the projections run as Triton kernels: the
row quantization (ddtree/kernels/rows.py), then the few-row GEMM on e4m3 operands (ddtree/kernels/gemm.py).
Elsewhere `ddtree.kernels.fp8.reference_linear` computes the same function in float32, slowly (the CPU reference
the kernels are tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.errors import DDTreeError
from ddtree.kernels.fp8 import Fp8Weight, quantize_weight
from ddtree.kernels.gemm import fp8_linear

FORMATS = ("none", "fp8")


class Fp8Linear(nn.Module):
    """A bias-free nn.Linear whose weight is kept only as an `Fp8Weight` (`weight`: the fp8 values, a buffer;
    `weight_scale`: their scales, per row or per `block`): an nn.Linear quantized per row, or a weight as loaded
    (an FP8 checkpoint's blocks). Quantize a module once it sits on its device in its dtype: a later
    `module.to(dtype)` would cast the fp8 buffer too."""

    def __init__(self, source: nn.Linear | Fp8Weight) -> None:
        super().__init__()
        if isinstance(source, nn.Linear):
            if source.bias is not None:
                raise DDTreeError("fp8 quantization takes bias-free projections only")
            source = quantize_weight(source.weight)
        self.out_features, self.in_features = source.shape
        self.register_buffer("weight", source.data, persistent=False)
        self.register_buffer("weight_scale", source.scale, persistent=False)
        self.block = source.block
        self.bias = None

    @property
    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8)


def check_format(quantization: str | None, what: str = "draft quantization") -> str | None:
    """None for no quantization (also for "none"); the format otherwise, or a one-line error."""
    if quantization in (None, "none"):
        return None
    if quantization not in FORMATS:
        raise DDTreeError(f"{what} must be one of {', '.join(FORMATS)}, got {quantization!r}")
    return quantization


def check_device(device: torch.device, what: str = "fp8 draft quantization") -> None:
    """fp8 on CUDA needs fp8 tensor cores; the CPU runs the float32 reference (for tests and demos)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise DDTreeError(f"{what} needs a GPU with fp8 tensor cores (compute capability 8.9 "
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
    return fp8_linear(hidden, weight, bias) if isinstance(weight, Fp8Weight) else F.linear(hidden, weight, bias)
