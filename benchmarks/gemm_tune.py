"""Skinny GEMMs on a GPU: cuBLAS (F.linear) against a plain Triton kernel (below).

For the Qwen3-8B shape's projections (q/k/v, o, gate/up, down, the LM head) at the row counts a round
meets: 1 (an AR step), 16 (a draft block or a dflash verify) and 65 (a budget-64 tree). Each timing is a
CUDA graph of 36 calls cycling over distinct weight copies (more bytes than L2 holds), median of replays;
the table gives µs per call and the bandwidth it reaches, the best Triton launch configs next to cuBLAS,
and what one AR step's GEMMs would take with the best of each.

    PYTHONPATH=server python benchmarks/gemm_tune.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from ddtree.fast.bench import graph_ms

CALLS = 36
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
PER_STEP = {"qkv": 36, "o": 36, "gate_up": 36, "down": 36, "lm_head": 1}  # calls in one AR step


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


def configs(m: int) -> list[dict]:
    block_m = 1 if m == 1 else max(16, 1 << (m - 1).bit_length())
    if m == 1:
        grid = itertools.product((8, 16, 32), (256, 512), (4, 8), (3,))
    else:
        grid = itertools.product((16, 32, 64), (128, 256), (4,), (3, 4))
    return [dict(block_m=block_m, block_n=n, block_k=k, num_warps=w, num_stages=s) for n, k, w, s in grid]


def per_call_us(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    def run() -> None:
        for i in range(CALLS):
            fn(x, weights[i % len(weights)])
    return 1e3 * graph_ms(run) / CALLS


def main() -> None:
    dev = torch.device("cuda")
    best_step = {"cublas": 0.0, "triton": 0.0}
    print("| proj | rows | variant | us | TB/s |\n|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, min(CALLS, -(-2 * 2**30 // nbytes)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(copies)]
        for m in (1, 16, 65):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            want = F.linear(x, weights[0]).float()
            results = [(per_call_us(F.linear, weights, x), "cublas")]
            for cfg in configs(m):
                try:
                    got = skinny_linear(x, weights[0], cfg).float()
                except triton.runtime.errors.OutOfResources:  # too much shared memory for this config
                    continue
                if not torch.allclose(got, want, atol=3e-2, rtol=3e-2):
                    print(f"| {name} | {m} | {cfg} | WRONG | |")
                    continue
                results.append((per_call_us(lambda a, w, cfg=cfg: skinny_linear(a, w, cfg), weights, x), str(cfg)))
            cublas = results[0][0]
            ranked = sorted(results[1:])
            for us, label in [results[0], *ranked[:3]]:
                print(f"| {name} | {m} | {label} | {us:.1f} | {nbytes / us / 1e6:.2f} |", flush=True)
            if m == 1:
                best_step["cublas"] += PER_STEP[name] * cublas
                best_step["triton"] += PER_STEP[name] * min(cublas, ranked[0][0] if ranked else cublas)
        del weights
        torch.cuda.empty_cache()
    print(f"\nOne AR step's GEMMs: cuBLAS {best_step['cublas'] / 1e3:.2f} ms, best of cuBLAS and Triton per "
          f"projection {best_step['triton'] / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
