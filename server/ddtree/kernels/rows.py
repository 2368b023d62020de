"""A multi-row forward's elementwise steps (RMSNorm, residual add + RMSNorm, SiLU · up, and fp8 projections' row
quantization) as Triton kernels launched as programmatic dependents.

An fp8 drafter's or target's norms and SiLU · up feed only its fp8 projections, so their `_fp8` forms write the
rows quantized (fp8.quantize_rows of the rows the plain kernel would write: per row, or per 128-column group
before a block-scaled checkpoint's projections), not the rows: one kernel where a norm and a quantization were
two, 16 fewer launches in an 8B draft pass (0.52 -> 0.50 ms). In half
precision the bits are the plain kernels'; in float32 a compiled norm's 1 / rms may come an ulp apart (its sum
of squares in another order), as it may from the reference's.

An AR step folds these steps into its GEMVs (ddtree/kernels/gemv.py). A draft block or a tree cannot: its
projections are GEMMs (ddtree/kernels/gemm.py, cuBLASLt), so each step is a kernel of its own between two of
them, three per layer. torch.compile makes each one kernel too, but an Inductor kernel starts only once the
GEMM before it has drained. These launch with PDL (ddtree/kernels/jit.py): a launch overlaps the tail of the
kernel before it, and its programs wait for that kernel's writes.

Rounding is the reference's (ddtree.models.draft.rms_norm, fused.silu_mul): the sum rounded to the model dtype, the
normalised row rounded before the scale, SiLU's output rounded before the product.
"""

from __future__ import annotations

import torch

from ddtree.kernels.fp8 import FP8, FP8_MAX, TINY, QuantizedRows
from ddtree.kernels.jit import after_previous, pdl, program_block
from ddtree.kernels.wgmma import early_pdl

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
    """ddtree.models.draft.rms_norm of rows x [n, K]."""
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


def rms_norm_fp8(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 group: int | None = None) -> tuple[QuantizedRows, torch.Tensor]:
    """(rms_norm(x) quantized, x), or with `delta` (add_rms_norm's output quantized, x + delta): one kernel. One
    scale per row, or per `group` columns (fp8.quantize_rows)."""
    values, scale = _quantized(x, group)
    summed = x if delta is None else torch.empty_like(x)
    _norm(x, x if delta is None else delta, summed, weight, values, eps, has_delta=delta is not None, scale=scale,
          group=group)
    return QuantizedRows(values, scale, x.dtype, group), summed


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


def silu_mul_fp8(gate_up: torch.Tensor, group: int | None = None) -> QuantizedRows:
    """silu_mul's output quantized (quantize_rows, per row or per `group` columns): the row quantization kernel,
    reading SiLU · up of its rows."""
    values, scale = _quantize(gate_up, gate_up.shape[1] // 2, silu=True, group=group)
    return QuantizedRows(values, scale, gate_up.dtype, group)


def quantize(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows of rows x [M, K] (fp8 projections' inputs): e4m3 values and float32 scales, per row or
    per `group` columns."""
    return _quantize(x, x.shape[1], silu=False, group=group)


def _quantize(x: torch.Tensor, k: int, silu: bool, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of _quantize_kernel over rows x [M, K] (with `silu`, SiLU · up of rows [M, 2K]), one program
    per row (every row in one program when interpreted)."""
    rows = x.shape[0]
    values, scale = _quantized(x[:, :k], group)
    block = _width(k, group)
    block_r = program_block(rows, x.device, 1)
    dependent = pdl(x.device)
    _quantize_kernel[(triton.cdiv(rows, block_r),)](
        x, values, scale, rows, k, x.stride(0), SILU=silu, BLOCK_R=block_r, BLOCK=block, GROUP=group or 0,
        PDL=dependent, num_warps=min(16, max(4, block // 1024)), launch_pdl=dependent)
    return values, scale


def _quantized(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 values and float32 scales for rows shaped like x [M, K]: [M], or [M, ceil(K / group)]."""
    rows, k = x.shape
    return (torch.empty(x.shape, dtype=FP8, device=x.device),
            torch.empty((rows, -(-k // group)) if group else rows, dtype=torch.float32, device=x.device))


def _width(k: int, group: int | None) -> int:
    """The columns a program's row tile spans: k's next power of two, at least one whole group."""
    return max(triton.next_power_of_2(k), group or 1)


def _norm(x: torch.Tensor, delta: torch.Tensor, summed: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
          eps: float, has_delta: bool, scale: torch.Tensor | None = None, group: int | None = None) -> None:
    """One launch of _norm_kernel; with `scale`, `out` takes the rows' e4m3 values and `scale` their scales (one
    per `group` columns, or per row)."""
    rows, k = x.shape
    block = _width(k, group)
    block_r = program_block(rows, x.device, 1)  # rows per program
    order = early_pdl(x.device, rows, "norm")
    _norm_kernel[(triton.cdiv(rows, block_r),)](
        x, delta, summed, weight, out, out if scale is None else scale, rows, k, x.stride(0), delta.stride(0), eps,
        BLOCK_R=block_r, BLOCK=block, HAS_DELTA=has_delta, FP8=scale is not None, GROUP=group or 0, PDL=order,
        num_warps=min(16, max(1, block // 512)), launch_pdl=order > 0)


if triton is not None:

    _INV_MAX = tl.constexpr(1.0 / FP8_MAX)
    _TINY = tl.constexpr(TINY)

    @triton.jit
    def e4m3_scale(largest):
        """quantize_rows' scale of a row whose largest magnitude is `largest`: at least TINY, x float32(1 / FP8_MAX)."""
        return tl.maximum(largest, _TINY) * _INV_MAX

    @triton.jit
    def to_e4m3(y, scale):
        """float32 values y / scale (correctly rounded: div_rn) in e4m3, rounded to nearest even: quantize_rows'."""
        return tl.math.div_rn(y, scale).to(tl.float8e4nv)

    @triton.jit
    def store_e4m3(Out, S, y, r, cols, ok, rows, K, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
                   GROUP: tl.constexpr):
        """float32 rows y [BLOCK_R, BLOCK] (rows r of [rows, K], columns cols; masked entries 0) stored as
        quantize_rows makes them (`e4m3_scale`, `to_e4m3`): e4m3 values to Out, and one scale per row to S [rows],
        or with GROUP (dividing BLOCK) one per GROUP columns to S [rows, cdiv(K, GROUP)]."""
        if GROUP:
            groups = tl.reshape(y, (BLOCK_R, BLOCK // GROUP, GROUP))
            scale = e4m3_scale(tl.max(tl.abs(groups), 2))
            values = tl.reshape(to_e4m3(groups, scale[:, :, None]), (BLOCK_R, BLOCK))
            g = tl.arange(0, BLOCK // GROUP)
            per_row = tl.cdiv(K, GROUP)
            tl.store(S + r[:, None] * per_row + g[None, :], scale, mask=(r < rows)[:, None] & (g < per_row)[None, :])
        else:
            scale = e4m3_scale(tl.max(tl.abs(y), 1))
            values = to_e4m3(y, scale[:, None])
            tl.store(S + r, scale, mask=r < rows)
        tl.store(Out + r[:, None] * K + cols[None, :], values, mask=ok)

    @triton.jit
    def _store_rows(Out, S, y, r, cols, ok, rows, K, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
                    FP8: tl.constexpr, GROUP: tl.constexpr):
        """Rows y [BLOCK_R, BLOCK] to Out as they are, or with FP8 quantized (`store_e4m3`, per row or per GROUP
        columns). Masked entries must be 0."""
        if FP8:
            store_e4m3(Out, S, y.to(tl.float32), r, cols, ok, rows, K, BLOCK_R, BLOCK, GROUP)
        else:
            tl.store(Out + r[:, None] * K + cols[None, :], y, mask=ok)

    @triton.jit
    def _norm_kernel(X, Delta, Summed, W, Out, S, rows, K, stride_x, stride_d, eps, BLOCK_R: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
                     PDL: tl.constexpr):
        """BLOCK_R rows: (x + delta, rounded, stored to Summed when HAS_DELTA) RMS-normed and scaled by W, then
        stored (`_store_rows`: quantized with FP8, per row or per GROUP columns)."""
        cols = tl.arange(0, BLOCK)
        w = tl.load(W + cols, mask=cols < K, other=0.0)  # a constant weight: read before the wait
        after_previous(PDL)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = (r < rows)[:, None] & (cols < K)[None, :]
        dtype = X.dtype.element_ty
        x = tl.load(X + r[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(Delta + r[:, None] * stride_d + cols[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
            tl.store(Summed + r[:, None] * K + cols[None, :], x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / K + eps)
        h = (xf * rstd[:, None]).to(dtype).to(tl.float32)
        _store_rows(Out, S, (w.to(tl.float32)[None, :] * h).to(dtype), r, cols, ok, rows, K, BLOCK_R, BLOCK, FP8,
                    GROUP)

    @triton.jit
    def _swiglu(src, half, ok, dtype):
        """SiLU(gate) rounded to dtype, times up, rounded: the gates at `src`, the ups `half` columns further."""
        gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        up = tl.load(src + half, mask=ok, other=0.0)
        return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)

    @triton.jit
    def _silu_kernel(GateUp, Out, total, half, stride_row, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """BLOCK consecutive outputs of the [rows, half] result (`_swiglu`)."""
        after_previous(PDL)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < total
        row, col = idx // half, idx % half
        tl.store(Out + idx, _swiglu(GateUp + row * stride_row + col, half, ok, Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _quantize_kernel(X, Q, S, rows, K, stride_x, SILU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
                         GROUP: tl.constexpr, PDL: tl.constexpr):
        """BLOCK_R rows as fp8.quantize_rows makes them (`store_e4m3`, per row or per GROUP columns): X's rows, or
        with SILU their SiLU · up (`_swiglu`: the gates in X's first K columns, the ups in the next K)."""
        after_previous(PDL)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK)
        ok = (r < rows)[:, None] & (cols < K)[None, :]
        src = X + r[:, None] * stride_x + cols[None, :]
        y = _swiglu(src, K, ok, X.dtype.element_ty) if SILU else tl.load(src, mask=ok, other=0.0)
        store_e4m3(Q, S, y.to(tl.float32), r, cols, ok, rows, K, BLOCK_R, BLOCK, GROUP)
