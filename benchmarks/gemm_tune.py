"""One-row projections on a GPU: cuBLAS against the fast path's fused Triton GEMV (ddtree/kernels/gemv.py).

For each projection of the Qwen3-8B shape at one row (an AR step), in the form an AR step runs it:

    qkv      residual add + RMSNorm, then q/k/v        gate_up  residual add + RMSNorm, then gate/up
    o        plain                                      down     SiLU(gate) * up, then down
    lm_head  residual add + final RMSNorm, then the LM head

the table gives µs per call for cuBLAS alone, cuBLAS plus the separate (compiled) kernel the GEMV folds
in, the GEMV at its default launch config, and the best few of a config grid, with the bandwidth reached
(weight bytes / time). Each timing is a CUDA graph of 36 calls cycling over distinct weight copies (more
bytes than L2 holds), median of replays. benchmarks/ab_steps.py times whole steps with the GEMVs on and off.

    PYTHONPATH=server python benchmarks/gemm_tune.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
from ddtree.bench.timing import cycled_us, weight_copies
from ddtree.fast.layers import Ops
from ddtree.kernels.gemv import NORM, PLAIN, SILU, gemv, launch_config

EPS = 1e-6
# name: (N, K, mode)
SHAPES = {"qkv": (6144, 4096, NORM), "o": (4096, 4096, PLAIN), "gate_up": (24576, 4096, NORM),
          "down": (4096, 12288, SILU), "lm_head": (151936, 4096, NORM)}
PER_STEP = {"qkv": 36, "o": 36, "gate_up": 36, "down": 36, "lm_head": 1}  # calls in one AR step


def configs() -> list[dict]:
    grid = itertools.product((4, 8, 16), (512, 1024), (1, 4), (4, 8))
    return [dict(block_n=n, block_k=k, unroll=u, num_warps=w, num_stages=1) for n, k, u, w in grid]


def sweep() -> None:
    ops = Ops(compile=True)
    step = {"cublas": 0.0, "default": 0.0, "best": 0.0}
    print("| proj | variant | us | TB/s |\n|---|---|---|---|")
    for name, (n, k, mode) in SHAPES.items():
        cublas, default, best = tune(name, n, k, mode, ops)
        step["cublas"] += PER_STEP[name] * cublas
        step["default"] += PER_STEP[name] * default
        step["best"] += PER_STEP[name] * best
        torch.cuda.empty_cache()
    print(f"\nOne AR step's projections with their folded steps: cuBLAS + kernels {step['cublas'] / 1e3:.2f} ms, "
          f"GEMV default configs {step['default'] / 1e3:.2f} ms, best configs {step['best'] / 1e3:.2f} ms")


def tune(name: str, n: int, k: int, mode: int, ops: Ops) -> tuple[float, float, float]:
    """Print one projection's rows; returns µs per call of (cuBLAS + folded step, GEMV default, GEMV best)."""
    dev = torch.device("cuda")
    nbytes = n * k * 2
    weights = weight_copies(n, k)
    width = 2 * k if mode == SILU else k
    x = torch.randn(1, width, device=dev, dtype=torch.bfloat16)
    delta = torch.randn(1, width, device=dev, dtype=torch.bfloat16)
    norm = torch.rand(width, device=dev, dtype=torch.bfloat16) + 0.5

    def unfused(w: torch.Tensor) -> torch.Tensor:
        if mode == NORM:
            return F.linear(ops.add_rms_norm(x, delta, norm, EPS)[0], w)
        return F.linear(ops.silu_mul(x) if mode == SILU else x, w)

    def fused(w: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
        return gemv(x, w, mode, delta if mode == NORM else None, norm, EPS, cfg)[0]

    want = unfused(weights[0]).float()
    rows = [("cuBLAS alone", cycled_us(lambda w: F.linear(x[:, :k], w), weights)),
            ("cuBLAS + its folded step", cycled_us(unfused, weights)),
            (f"gemv default {launch_config(n, k)}", cycled_us(fused, weights))]
    tried = []
    for cfg in configs():
        try:
            got = fused(weights[0], cfg).float()
        except triton.runtime.errors.OutOfResources:
            continue
        if not torch.allclose(got, want, atol=5e-2, rtol=5e-2):
            print(f"| {name} | {cfg} | WRONG | |")
            continue
        tried.append((cycled_us(lambda w, cfg=cfg: fused(w, cfg), weights), str(cfg)))
    tried.sort()
    for label, us in [*rows, *((label, us) for us, label in tried[:4])]:
        print(f"| {name} | {label} | {us:.1f} | {nbytes / us / 1e6:.2f} |", flush=True)
    return rows[1][1], rows[2][1], tried[0][0] if tried else rows[2][1]


if __name__ == "__main__":
    sweep()
