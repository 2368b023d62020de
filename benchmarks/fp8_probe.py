"""Would float8 draft weights pay? cuBLASLt's fp8 GEMM (torch._scaled_mm, row-wise scales) against bf16 cuBLAS
at a draft block's rows, for the Qwen3-8B-DFlash-b16 draft's projections.

Half the weight bytes only help if the fp8 GEMM streams them as fast; at 16-32 rows it does not (see
benchmarks/RESULTS.md, "Fast path v7"), so the drafter stays in the target's dtype. Per projection: µs per
call (36 calls over distinct weight copies in one CUDA graph), the bandwidth reached on the weight's own
bytes, the fp8 call with its activations quantised per row by a compiled kernel, and the relative error
of the fp8 product against the bf16 one.

    PYTHONPATH=server python benchmarks/fp8_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ddtree.bench.command import cycled_us, weight_copies

FP8_MAX = 448.0
SHAPES = {"q": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288), "lm_head": (151936, 4096),
          "fc": (4096, 20480), "context_kv": (10240, 4096)}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows scaled so each row's largest magnitude is fp8's largest value: (fp8 rows, scales [M, 1])."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_mm(x8: tuple[torch.Tensor, torch.Tensor], w8: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch._scaled_mm(x8[0], w8[0].t(), x8[1], w8[1], out_dtype=torch.bfloat16)


def probe(name: str, n: int, k: int, rows: int, quantize) -> None:
    dense = weight_copies(n, k)
    weights = [(w8, scale.T.contiguous()) for w8, scale in map(quantize_rows, dense)]  # per-column scales [1, N]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x8 = quantize_rows(x)
    bf16 = cycled_us(lambda w: F.linear(x, w), dense)
    fp8 = cycled_us(lambda w: fp8_mm(x8, w), weights)
    with_quant = cycled_us(lambda w: fp8_mm(quantize(x), w), weights)
    want = F.linear(x.float(), dense[0].float())
    error = ((fp8_mm(x8, weights[0]).float() - want).norm() / want.norm()).item()
    print(f"| {name} | {rows} | {bf16:.1f} ({n * k * 2 / bf16 / 1e6:.2f} TB/s) | {fp8:.1f} ({n * k / fp8 / 1e6:.2f} "
          f"TB/s) | {with_quant:.1f} | {error:.4f} |", flush=True)


def main() -> None:
    quantize = torch.compile(quantize_rows)
    print("| proj | rows | bf16 cuBLAS us | fp8 cuBLASLt us | fp8 + row quantisation us | fp8 rel. error |\n"
          "|---|---|---|---|---|---|")
    for rows in (16, 32):
        for name, (n, k) in SHAPES.items():
            probe(name, n, k, rows, quantize)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
