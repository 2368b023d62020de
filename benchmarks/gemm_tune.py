"""Skinny GEMMs on a GPU: cuBLAS (F.linear) against the Triton kernel in ddtree/fast/gemm.py.

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
from ddtree.fast.bench import graph_ms
from ddtree.fast.gemm import skinny_linear

CALLS = 36
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
PER_STEP = {"qkv": 36, "o": 36, "gate_up": 36, "down": 36, "lm_head": 1}  # calls in one AR step


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
                got = skinny_linear(x, weights[0], cfg).float()
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
