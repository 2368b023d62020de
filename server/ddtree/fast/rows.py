"""A multi-row forward's elementwise steps (RMSNorm, residual add + RMSNorm, SiLU · up, and an fp8 drafter's
row quantization) as Triton kernels launched as programmatic dependents.

An AR step folds these steps into its GEMVs (ddtree/fast/gemv.py). A draft block or a tree cannot: its
projections are GEMMs (ddtree/fast/gemm.py, cuBLASLt), so each step is a kernel of its own between two of
them, three per layer. torch.compile makes each one kernel too, but an Inductor kernel starts only once the
GEMM before it has drained. These launch with PDL (ddtree/fast/jit.py): a launch overlaps the tail of the
kernel before it, and its programs wait for that kernel's writes.

Rounding is the reference's (ddtree.draft.rms_norm, fused.silu_mul): the sum rounded to the model dtype, the
normalised row rounded before the scale, SiLU's output rounded before the product.
"""

from __future__ import annotations

import torch

from ddtree.fast.jit import after_previous, pdl, program_block
from ddtree.quantize import FP8, FP8_MAX, TINY

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fused.Ops keeps the PyTorch functions
    triton = None

SILU_BLOCK = 2048  # SiLU · up elements per program on a GPU (`jit.program_block`)


def supported(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the kernels take these rows: 2-D with contiguous columns, and a norm weight of the rows' dtype
    and width (else the PyTorch function, whose type promotion the kernels do not copy)."""
    return (x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (weight is None or (weight.dtype == x.dtype and weight.shape == (x.shape[1],))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ddtree.draft.rms_norm of rows x [n, K]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, x, x, weight, out, eps, has_delta=False)
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.add_rms_norm: (norm(residual + delta), residual + delta) of rows [n, K]."""
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    summed = torch.empty_like(out)
    _norm(residual, delta, summed, weight, out, eps, has_delta=True)
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """fused.silu_mul: SiLU(gate) * up of rows [n, 2I] (gate the first half) -> [n, I]."""
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty((rows, half), dtype=gate_up.dtype, device=gate_up.device)
    dependent = pdl(gate_up.device)
    block = program_block(rows * half, gate_up.device, SILU_BLOCK)
    _silu_kernel[(triton.cdiv(rows * half, block),)](
        gate_up, out, rows * half, half, gate_up.stride(0), BLOCK=block, PDL=dependent, num_warps=4,
        launch_pdl=dependent)
    return out


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ddtree.quantize.quantize_rows of rows x [M, K] (an fp8 drafter's projection inputs): e4m3 values and
    per-row float32 scales, one program per row (every row in one program when interpreted)."""
    rows, k = x.shape
    values = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    block_r = program_block(rows, x.device, 1)
    dependent = pdl(x.device)
    _quantize_kernel[(triton.cdiv(rows, block_r),)](
        x, values, scale, rows, k, x.stride(0), BLOCK_R=block_r, BLOCK=block, PDL=dependent,
        num_warps=min(16, max(4, block // 1024)), launch_pdl=dependent)
    return values, scale


def _norm(x: torch.Tensor, delta: torch.Tensor, summed: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
          eps: float, has_delta: bool) -> None:
    rows, k = x.shape
    block = triton.next_power_of_2(k)
    block_r = program_block(rows, x.device, 1)  # rows per program
    dependent = pdl(x.device)
    _norm_kernel[(triton.cdiv(rows, block_r),)](
        x, delta, summed, weight, out, rows, k, x.stride(0), delta.stride(0), eps, BLOCK_R=block_r, BLOCK=block,
        HAS_DELTA=has_delta, PDL=dependent, num_warps=min(16, max(1, block // 512)), launch_pdl=dependent)


if triton is not None:

    @triton.jit
    def _norm_kernel(X, Delta, Summed, W, Out, rows, K, stride_x, stride_d, eps, BLOCK_R: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, PDL: tl.constexpr):
        """BLOCK_R rows: (x + delta, rounded, stored to Summed when HAS_DELTA) RMS-normed and scaled by W."""
        cols = tl.arange(0, BLOCK)
        w = tl.load(W + cols, mask=cols < K, other=0.0)  # a constant weight: read before the wait
        after_previous(PDL)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = (r < rows)[:, None] & (cols < K)[None, :]
        dtype = Out.dtype.element_ty
        x = tl.load(X + r[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(Delta + r[:, None] * stride_d + cols[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
            tl.store(Summed + r[:, None] * K + cols[None, :], x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / K + eps)
        h = (xf * rstd[:, None]).to(dtype).to(tl.float32)
        tl.store(Out + r[:, None] * K + cols[None, :], (w.to(tl.float32)[None, :] * h).to(dtype), mask=ok)

    @triton.jit
    def _silu_kernel(GateUp, Out, total, half, stride_row, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """BLOCK consecutive outputs of the [rows, half] result: SiLU(gate) rounded, times up, rounded."""
        after_previous(PDL)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < total
        row, col = idx // half, idx % half
        src = GateUp + row * stride_row + col
        gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        dtype = Out.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        up = tl.load(src + half, mask=ok, other=0.0)
        tl.store(Out + idx, (act.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=ok)

    _INV_MAX = tl.constexpr(1.0 / FP8_MAX)
    _TINY = tl.constexpr(TINY)

    @triton.jit
    def _quantize_kernel(X, Q, S, rows, K, stride_x, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        """BLOCK_R rows as ddtree.quantize.quantize_rows makes them: scale = largest magnitude (at least TINY) x
        float32(1 / FP8_MAX), values / scale (correctly rounded: div_rn) in e4m3, rounded to nearest even."""
        after_previous(PDL)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK)
        ok = (r < rows)[:, None] & (cols < K)[None, :]
        x = tl.load(X + r[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 1), _TINY) * _INV_MAX
        values = tl.math.div_rn(x, scale[:, None])
        tl.store(Q + r[:, None] * K + cols[None, :], values.to(Q.dtype.element_ty), mask=ok)
        tl.store(S + r, scale, mask=r < rows)
