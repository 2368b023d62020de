"""Products and attention on the CPU whose every row has the same bits at any row count.

Greedy `ddtree` emits exactly what greedy `ar` emits only if a row's verify forward (a tree's rows at once) gives
the bits of its AR step (one row). The CPU's float32 GEMM and SDPA kernels do not: they pick their blocking, and
with it their order of sums, by shape, so a row's result moves by an ulp with the rows around it. In a bf16 or
float32 model an ulp moves a greedy pick only at an exact near-tie; in an fp8 model it moves an e4m3 rounding of
the next projection's input (one step: ~6 % of that value), and in the tiny test models one such step moves the
logits by a few hundredths, which flips a pick (eight tiny Qwen3-MoE FP8s at hidden 256: greedy ddtree parted from
its own ar on 2 of 16 prompts, on either path). Summed in float64 and rounded once to the model's dtype, a product or an
attention row is the correctly rounded value up to float64's own error (2^-53, which a rounding to float32 hides
but for one value in ~2^29): the same at any row count and in either path's implementation. fp8 products already
sum so (fp8.reference_mm); here the model's own dtype's products and attention: the CPU fast path's fallbacks
of an fp8 target (`for_fp8_targets`: the fast path runs on the CPU for the tests, which hold it to the
reference's bits) and, through `RowInvariant`, an fp8 target's transformers forward on the reference path. A bf16
target there keeps the float32 kernels: an ulp moves its picks only at exact near-ties, and in float64 the CPU
demo's rounds would take 25-35 % longer. GPU tensors are left to their kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def takes(x: torch.Tensor) -> bool:
    """Whether x's products go through this module: a floating-point tensor below float64 on the CPU."""
    return x.device.type == "cpu" and x.dtype in FLOATS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear summed in float64, rounded to x's dtype."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              **options: Any) -> torch.Tensor:
    """F.scaled_dot_product_attention in float64 (an additive mask too), rounded to q's dtype."""
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=attn_mask,
                                          **options).to(q.dtype)


class RowInvariant(TorchFunctionMode):
    """Within it, F.linear and F.scaled_dot_product_attention on CPU tensors run as `linear` and `attention`
    (the reference path's transformers forward: Target.forward)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and takes(first):
            if func is F.linear:
                return linear(*args, **kwargs)
            if func is F.scaled_dot_product_attention:
                return attention(*args, **kwargs)
        return func(*args, **kwargs)


def where_fp8(device: torch.device, quantization: str | None) -> AbstractContextManager:
    """RowInvariant for an fp8 target's forward on the CPU (`quantization`: the target's, None when in its dtype),
    else nothing: a bf16 or float32 target keeps the CPU's float32 kernels (in float64 the CPU demo's rounds take
    25-50 % longer). The rule of both paths: the reference path's Target.forward and `for_fp8_targets`."""
    return RowInvariant() if device.type == "cpu" and quantization else nullcontext()


def for_fp8_targets(forward: Callable) -> Callable:
    """A fast path's target forward (a method of an object with `device` and `target`) run `where_fp8`."""

    @functools.wraps(forward)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with where_fp8(self.device, self.target.quantization):
            return forward(self, *args, **kwargs)

    return run
