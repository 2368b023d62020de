"""Skinny GEMMs (1 to ~130 rows) as one Triton kernel, for the batch-1 steps that read whole weights.

A decode step multiplies a handful of rows by every weight once, so it is bound by reading the weights.
Each program owns BLOCK_N output columns for all (up to BLOCK_M) rows and streams its [BLOCK_N, K] slab
of the weight once; one row uses FMAs and a reduction, more rows use tensor cores (tl.dot).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, cfg: dict) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, with launch config `cfg`
    (block_m, block_n, block_k, num_warps, num_stages)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["block_n"]), triton.cdiv(m, cfg["block_m"]))
    _skinny_kernel[grid](x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0), K=k,
                         BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


if triton is not None:

    @triton.jit
    def _skinny_kernel(X, W, Y, M, N, stride_x, stride_w, stride_y, K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K is constant per weight: one compile per width
            cols = k0 + rk
            x = tl.load(X + rm[:, None] * stride_x + cols[None, :], mask=(rm[:, None] < M) & (cols[None, :] < K),
                        other=0.0)
            w = tl.load(W + rn[:, None] * stride_w + cols[None, :], mask=(rn[:, None] < N) & (cols[None, :] < K),
                        other=0.0)
            if BLOCK_M >= 16:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
