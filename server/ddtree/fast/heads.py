"""The new rows' attention heads in one Triton kernel: q/k norm, RoPE, query layout and the K/V cache write.

`fused.attention_heads` compiled by torch.compile is three kernels (q norm + RoPE, k norm + RoPE + the cache
write, the query layout), about 6 µs per layer at an AR step: 36 layers make it 0.2 ms of a 4.5 ms step.
Here one program per (row, head) does all of it for its head: a query head lands in the grouped layout
the attention kernel reads; a K/V head's k (normed, rotated) and v go to the cache rows `slots`.

Rounding follows the reference's RMSNorm (normalised in float32, rounded, scaled in the model dtype); the
rotation is computed in float32 and rounded once, as the compiled function does.
"""

from __future__ import annotations

import torch

from ddtree.fast.jit import after_previous, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fused.attention_heads instead
    triton = None


def attention_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    kv_heads: int, head_dim: int, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """fused.attention_heads (same arguments, same result): rows q [n, H*d], k, v [n, kv*d] (row-strided
    views allowed) -> queries [kv, groups*n, d]; K/V written to cache [2, kv, T, d] at `slots`."""
    n = q.shape[0]
    heads = q.shape[1] // head_dim
    out = torch.empty((kv_heads, heads // kv_heads * n, head_dim), dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    dependent = pdl(q.device)
    _heads_kernel[(n, heads + kv_heads)](
        q, k, v, q_norm if has_norm else q, k_norm if has_norm else k, cos, sin, cache, slots, out, n,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), eps,
        HEADS=heads, GROUPS=heads // kv_heads, D=head_dim, HAS_NORM=has_norm, PDL=dependent,
        num_warps=1, launch_pdl=dependent)
    return out


if triton is not None:

    @triton.jit
    def _normed(X, W, dims, r, HAS_NORM: tl.constexpr):
        """Entries `dims` of a head row as float32, RMS-normed (row scale r) and rounded as the reference rounds."""
        x = tl.load(X + dims).to(tl.float32)
        if HAS_NORM:
            x = (x * r).to(X.dtype.element_ty).to(tl.float32)
            x = (tl.load(W + dims).to(tl.float32) * x).to(X.dtype.element_ty).to(tl.float32)
        return x

    @triton.jit
    def _rotated(X, W, dims, cos, sin, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
        """One head row normed (when HAS_NORM) and rotated: x * cos + rotate_half(x) * sin, in float32."""
        r = 0.0
        if HAS_NORM:
            x = tl.load(X + dims).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        half = D // 2
        x = _normed(X, W, dims, r, HAS_NORM)
        partner = _normed(X, W, (dims + half) % D, r, HAS_NORM)
        return x * cos + tl.where(dims < half, -partner, partner) * sin

    @triton.jit
    def _heads_kernel(Q, K, V, QN, KN, Cos, Sin, Cache, Slots, Out, n, stride_q, stride_k, stride_v, stride_cos,
                      stride_plane, stride_head, stride_row, eps, HEADS: tl.constexpr, GROUPS: tl.constexpr,
                      D: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr):
        """Program (t, h): query head h of row t (h < HEADS), else K/V head h - HEADS."""
        after_previous(PDL)
        t, h = tl.program_id(0), tl.program_id(1)
        dims = tl.arange(0, D)
        cos = tl.load(Cos + t * stride_cos + dims).to(tl.float32)
        sin = tl.load(Sin + t * stride_cos + dims).to(tl.float32)
        if h < HEADS:
            x = _rotated(Q + t * stride_q + h * D, QN, dims, cos, sin, eps, D, HAS_NORM)
            row = (h // GROUPS) * GROUPS * n + (h % GROUPS) * n + t  # [kv, groups * n] grouped layout
            tl.store(Out + row * D + dims, x.to(Out.dtype.element_ty))
        else:
            j = h - HEADS
            slot = tl.load(Slots + t)
            x = _rotated(K + t * stride_k + j * D, KN, dims, cos, sin, eps, D, HAS_NORM)
            dst = Cache + j * stride_head + slot * stride_row + dims
            tl.store(dst, x.to(Cache.dtype.element_ty))
            tl.store(dst + stride_plane, tl.load(V + t * stride_v + j * D + dims))
