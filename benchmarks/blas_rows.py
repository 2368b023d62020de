"""cuBLAS against cuBLASLt at a tree verify's row counts (the projections `gemm.linear` leaves to a BLAS).

For each projection of the Qwen3-8B target, µs per call of: F.linear as torch runs it (cuBLAS); F.linear with
a zero bias, which torch's addmm runs through cuBLASLt (the route `gemm.linear` takes for 33-128 rows); and
F.linear with cuBLASLt as torch's preferred BLAS library (a process-wide switch). Each timing is a CUDA graph
of calls cycling over distinct weight copies (more bytes than L2 holds). Then one step's sum over its
calls, and the largest difference between the zero-bias and the plain product.

    PYTHONPATH=server python benchmarks/blas_rows.py [--rows 33 48 65 80 129 512]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from ddtree.bench.command import cycled_us, weight_copies
from skinny_tune import TARGET  # the Qwen3-8B projections, name: (N, K, calls per step)

VARIANTS = ("cuBLAS", "cuBLASLt (zero bias)", "cuBLASLt (preferred library)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[33, 48, 65, 80, 129, 512])
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    us: dict[tuple[str, str, int], float] = {}
    differs: dict[str, float] = {}
    for name, (n, k, _) in TARGET.items():
        weights = weight_copies(n, k)
        zero = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            us[VARIANTS[0], name, rows] = cycled_us(lambda w, x=x: F.linear(x, w), weights)
            us[VARIANTS[1], name, rows] = cycled_us(lambda w, x=x, zero=zero: F.linear(x, w, zero), weights)
            diff = (F.linear(x, weights[0], zero).float() - F.linear(x, weights[0]).float()).abs().max().item()
            differs[f"{name}/{rows}"] = round(diff, 4)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            us[VARIANTS[2], name, rows] = cycled_us(lambda w, x=x: F.linear(x, w), weights)
            torch.backends.cuda.preferred_blas_library("cublas")
        del weights
        torch.cuda.empty_cache()
        print(f"({name} timed)", flush=True)
    for variant in VARIANTS:
        print(f"\n### {variant}: µs per call, and one step's projections (ms)\n")
        print("| rows | " + " | ".join(TARGET) + " | step ms |")
        print("|---" * (len(TARGET) + 2) + "|")
        for rows in args.rows:
            row = [us[variant, name, rows] for name in TARGET]
            step = sum(t * TARGET[name][2] for t, name in zip(row, TARGET, strict=True)) / 1e3
            print(f"| {rows} | " + " | ".join(f"{t:.1f}" for t in row) + f" | {step:.3f} |")
    print(f"\nmax |zero bias - plain| (bf16 outputs), per projection/rows: {differs}")


if __name__ == "__main__":
    main()
