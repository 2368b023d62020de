"""One-row projections (an AR step) as Triton GEMVs that fold in the step before them.

An AR step multiplies one row by every weight of the model; the weights' bytes are the whole cost, but
cuBLAS reaches only 2.5–3.4 TB/s on the 4096-wide projections of an 8B model, and
the tiny kernels between the projections (residual add + RMSNorm, SiLU · up) cost a launch and a ramp
each. Here one kernel reads the weight once, streaming tiles of BLOCK_N output rows, and computes its
input on the fly from the previous step's outputs:

    rows = rms_norm(residual + delta) * g   (NORM: the layer's norms and the final norm; writes the new residual)
    rows = silu(gate) * up                  (SILU: the down projection reads the gate/up GEMM's output)
    rows = x                                (PLAIN)

The input is rounded where the reference rounds it (the normalised row to the model dtype before the
scale, SiLU's output before the product), so the row fed to the dot is the reference's (up to the order of
the float32 sum of squares); the dot's float32 accumulation runs in another order than cuBLAS'.
"""

from __future__ import annotations

import torch

from ddtree.kernels.jit import after_previous, pdl, probe

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the caller keeps F.linear
    triton = None

PLAIN, NORM, SILU = 0, 1, 2


def launch_config(n: int, k: int) -> dict[str, int]:
    """Rows per program, K tile, loop unrolling and warps for an [n, k] weight.

    From benchmarks/gemm_tune.py on an H200 (Qwen3-8B widths): narrow weights (o, down) take 8-row tiles,
    so that 512 programs keep every SM busy; q/k/v, whose normed input costs each program a pass over the
    row first, does best with half as many programs of twice the warps; the wide ones (gate/up, LM head)
    are near the copy bandwidth with plain 8-row tiles.
    """
    block_k = next(b for b in (512, 256, 128, 64, 32, 16) if k % b == 0)
    if n <= 4096:
        return dict(block_n=8, block_k=block_k, unroll=2, num_warps=4, num_stages=1)
    if n <= 8192:
        return dict(block_n=16, block_k=block_k, unroll=1, num_warps=8, num_stages=1)
    return dict(block_n=8, block_k=block_k, unroll=1, num_warps=4, num_stages=1)


def gemv(x: torch.Tensor, weight: torch.Tensor, mode: int = PLAIN, delta: torch.Tensor | None = None,
         norm: torch.Tensor | None = None, eps: float = 0.0, config: dict[str, int] | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [N, K] times one input row built from x by `mode` -> (y [1, N], the new residual or None).

    PLAIN: x [1, K]. NORM: x is the residual [1, K], `delta` the pending add (or None), `norm` the RMSNorm
    weight; the second output is residual + delta (x itself when there is no delta). SILU: x is [1, 2K],
    the gate then the up half.
    """
    y, residual = _launch(x, weight, mode, delta, norm, eps, config, None)
    if mode == NORM:
        return y, residual if residual is not None else x
    return y, None


def norm_gemv(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gemv` in NORM mode that also hands back the normed row it multiplied: (y [1, N], the new residual,
    the row [1, K]), for a block that reads the row again after this projection (a mixture-of-experts
    block's experts after its router)."""
    row = torch.empty_like(x)
    y, residual = _launch(x, weight, NORM, delta, norm, eps, None, row)
    return y, residual if residual is not None else x, row


def _launch(x: torch.Tensor, weight: torch.Tensor, mode: int, delta: torch.Tensor | None,
            norm: torch.Tensor | None, eps: float, config: dict[str, int] | None,
            row: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = weight.shape
    cfg = config or launch_config(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    residual = torch.empty_like(x) if mode == NORM and delta is not None else None
    dependent = pdl(x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, delta if delta is not None else x, residual if residual is not None else x,
        norm if norm is not None else x, weight, y, row if row is not None else x, n, weight.stride(0), eps,
        K=k, MODE=mode, HAS_DELTA=delta is not None, WRITE_ROW=row is not None, BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], UNROLL=cfg["unroll"], PDL=dependent, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], launch_pdl=dependent)
    return y, residual


def supported(weight: torch.Tensor) -> bool:
    """Whether `weight` suits the kernel: 2-D, contiguous rows, K a multiple of the smallest K tile."""
    return weight.dim() == 2 and weight.stride(1) == 1 and weight.shape[1] % 16 == 0


if triton is not None:

    @triton.jit
    def _input_tile(X, Delta, G, cols, rstd, K: tl.constexpr, MODE: tl.constexpr, HAS_DELTA: tl.constexpr):
        """Columns `cols` of the row the weight multiplies, as float32, rounded where the reference rounds."""
        dtype = X.dtype.element_ty
        if MODE == 1:
            x = tl.load(X + cols)
            if HAS_DELTA:
                x = (x.to(tl.float32) + tl.load(Delta + cols).to(tl.float32)).to(dtype)
            h = (x.to(tl.float32) * rstd).to(dtype)
            return (tl.load(G + cols).to(tl.float32) * h.to(tl.float32)).to(dtype).to(tl.float32)
        elif MODE == 2:
            gate = tl.load(X + cols).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            return (act.to(tl.float32) * tl.load(X + K + cols).to(tl.float32)).to(dtype).to(tl.float32)
        else:
            return tl.load(X + cols).to(tl.float32)

    @triton.jit
    def _accumulate(acc, w, X, Delta, G, Row, cols, rstd, pid, K: tl.constexpr, MODE: tl.constexpr,
                    HAS_DELTA: tl.constexpr, WRITE_ROW: tl.constexpr):
        """acc + one weight tile `w` times the input row's columns `cols` (stored to Row by the first program
        with WRITE_ROW)."""
        row = _input_tile(X, Delta, G, cols, rstd, K, MODE, HAS_DELTA)
        if WRITE_ROW:  # by the first program only
            tl.store(Row + cols, row.to(Row.dtype.element_ty), mask=cols < tl.where(pid == 0, K, 0))
        return acc + w.to(tl.float32) * row[None, :]

    @triton.jit
    def _gemv_kernel(X, Delta, Res, G, W, Y, Row, N, stride_w, eps, K: tl.constexpr, MODE: tl.constexpr,
                     HAS_DELTA: tl.constexpr, WRITE_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        """BLOCK_N output rows of y = W @ row(X): float32 partial products kept per column, summed once; the
        main loop unrolled UNROLL times so several weight tiles are in flight per program. With WRITE_ROW
        the first program also stores the row it built. The first weight tile is read before waiting for the
        kernel before (PDL): the weights are constant, so memory streams while that kernel drains."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = (rn < N)[:, None]
        w_ptrs = W + rn[:, None] * stride_w + rk[None, :]
        first = tl.load(w_ptrs, mask=row_ok, other=0.0, eviction_policy="evict_first")
        after_previous(PDL)
        rstd = 0.0
        if MODE == 1:  # the row's RMS first: K values, read again from cache by the main loop
            squares = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(X + k0 + rk)
                if HAS_DELTA:
                    x = x.to(tl.float32) + tl.load(Delta + k0 + rk).to(tl.float32)
                    x = x.to(X.dtype.element_ty)
                    if pid == 0:  # one program writes the summed residual for the next layer
                        tl.store(Res + k0 + rk, x)
                x = x.to(tl.float32)
                squares += x * x
            rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc = _accumulate(acc, first, X, Delta, G, Row, rk, rstd, pid, K, MODE, HAS_DELTA, WRITE_ROW)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, loop_unroll_factor=UNROLL):
            w = tl.load(w_ptrs + k0, mask=row_ok, other=0.0, eviction_policy="evict_first")
            acc = _accumulate(acc, w, X, Delta, G, Row, k0 + rk, rstd, pid, K, MODE, HAS_DELTA, WRITE_ROW)
        tl.store(Y + rn, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=rn < N)


@probe
def _smoke_test(device: torch.device) -> None:
    """A normed one-row GEMV."""
    row, ones = torch.zeros(1, 16, device=device), torch.ones(16, device=device)
    gemv(row, torch.zeros(16, 16, device=device), NORM, row, ones, 1e-6)
