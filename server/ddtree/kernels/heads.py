"""The new rows' attention heads in one Triton kernel: q/k norm, RoPE, query layout and the K/V cache write.

`fused.attention_heads` compiled by torch.compile is three kernels (q norm + RoPE, k norm + RoPE + the cache
write, the query layout), about 6 µs per layer at an AR step: 36 layers make it 0.2 ms of a 4.5 ms step.
Here one program per (block of rows, head) does all of it for its head: a query head lands in the grouped layout
the attention kernel reads; a K/V head's k (normed, rotated) and v go to the cache rows `slots`.

Rounding follows the reference's RMSNorm (normalised in float32, rounded, scaled in the model dtype); the
rotation is computed in float32 and rounded once, as the compiled function does.
"""

from __future__ import annotations

import torch

from ddtree.kernels.jit import after_previous, probe, program_block
from ddtree.kernels.wgmma import early_pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fused.attention_heads instead
    triton = None

ROWS_PER_PROGRAM = 2  # on a GPU: B = 64 rounds were 0.05 ms faster than at 1 row a program


def launch_rows(n: int, device: torch.device) -> int:
    """Rows per program (a power of two): ROWS_PER_PROGRAM on a GPU (`jit.program_block`)."""
    return program_block(n, device, min(ROWS_PER_PROGRAM, triton.next_power_of_2(n)))


def attention_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    kv_heads: int, head_dim: int, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """fused.attention_heads (same arguments, same result): rows q [n, H*d], k, v [n, kv*d] (row-strided
    views allowed) -> queries [kv, groups*n, d]; K/V written to cache [2, kv, T, d] at `slots`."""
    n = q.shape[0]
    heads = q.shape[1] // head_dim
    out = torch.empty((kv_heads, heads // kv_heads * n, head_dim), dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    order = early_pdl(q.device, n, "heads")
    block_t = launch_rows(n, q.device)
    _heads_kernel[(triton.cdiv(n, block_t), heads + kv_heads)](
        q, k, v, q_norm if has_norm else q, k_norm if has_norm else k, cos, sin, cache, slots, out, n,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), eps,
        HEADS=heads, GROUPS=heads // kv_heads, D=head_dim, HAS_NORM=has_norm, BLOCK_T=block_t, PDL=order,
        num_warps=1 if block_t == 1 else 4, launch_pdl=order > 0)
    return out


if triton is not None:

    @triton.jit
    def _normed(X, W, offsets, dims, r, ok, HAS_NORM: tl.constexpr):
        """Entries `offsets` (head dims `dims`) of head rows as float32, RMS-normed (row scales r) and rounded
        as the reference rounds."""
        x = tl.load(X + offsets, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            x = (x * r[:, None]).to(X.dtype.element_ty).to(tl.float32)
            x = (tl.load(W + dims).to(tl.float32)[None, :] * x).to(X.dtype.element_ty).to(tl.float32)
        return x

    @triton.jit
    def _rotated(X, stride, W, t, dims, ok, cos, sin, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
        """Rows t of one head [BLOCK_T, D] normed (when HAS_NORM) and rotated: x * cos + rotate_half(x) * sin,
        in float32."""
        rows = t[:, None] * stride
        r = tl.zeros(t.shape, tl.float32)
        if HAS_NORM:
            x = tl.load(X + rows + dims[None, :], mask=ok, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        half = D // 2
        x = _normed(X, W, rows + dims[None, :], dims, r, ok, HAS_NORM)
        partner = _normed(X, W, rows + ((dims + half) % D)[None, :], (dims + half) % D, r, ok, HAS_NORM)
        return x * cos + tl.where((dims < half)[None, :], -partner, partner) * sin

    @triton.jit
    def _heads_kernel(Q, K, V, QN, KN, Cos, Sin, Cache, Slots, Out, n, stride_q, stride_k, stride_v, stride_cos,
                      stride_plane, stride_head, stride_row, eps, HEADS: tl.constexpr, GROUPS: tl.constexpr,
                      D: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        """Program (b, h): rows b * BLOCK_T.. of query head h (h < HEADS), else of K/V head h - HEADS."""
        after_previous(PDL)
        h = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        dims = tl.arange(0, D)
        ok = (t < n)[:, None]
        trig = t[:, None] * stride_cos + dims[None, :]
        cos = tl.load(Cos + trig, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(Sin + trig, mask=ok, other=0.0).to(tl.float32)
        if h < HEADS:
            x = _rotated(Q + h * D, stride_q, QN, t, dims, ok, cos, sin, eps, D, HAS_NORM)
            row = (h // GROUPS) * GROUPS * n + (h % GROUPS) * n + t  # [kv, groups * n] grouped layout
            tl.store(Out + row[:, None] * D + dims[None, :], x.to(Out.dtype.element_ty), mask=ok)
        else:
            j = h - HEADS
            slot = tl.load(Slots + t, mask=t < n, other=0)
            x = _rotated(K + j * D, stride_k, KN, t, dims, ok, cos, sin, eps, D, HAS_NORM)
            dst = Cache + j * stride_head + slot[:, None] * stride_row + dims[None, :]
            tl.store(dst, x.to(Cache.dtype.element_ty), mask=ok)
            tl.store(dst + stride_plane, tl.load(V + t[:, None] * stride_v + j * D + dims[None, :], mask=ok), mask=ok)


@probe
def _smoke_test(device: torch.device) -> None:
    """One row's attention heads."""
    row, ones = torch.zeros(1, 16, device=device), torch.ones(16, device=device)
    attention_heads(row, row, row, ones, ones, 1e-6, row, row, 1, 16, torch.zeros(2, 1, 4, 16, device=device),
                    torch.zeros(1, dtype=torch.long, device=device))
