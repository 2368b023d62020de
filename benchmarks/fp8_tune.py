"""Would float8 draft weights pay through a Triton fp8 x fp8 few-row GEMM? (cuBLASLt's fp8 GEMM did not:
fp8_probe.py, RESULTS v7.) It did: this is the probe behind `--draft-quantization fp8`.

The draft block's projections at 16 rows: the fast path's bf16 skinny GEMM (default launch rule) against the
same kernel on fp8 operands (ddtree/kernels/gemm.py's `skinny_fp8`: e4m3 weights and rows, per-output-channel weight
scales and per-row activation scales applied after the sum) over a grid of tiles. Also the per-row activation
quantisation kernel, and the round's projection time summed over one draft pass plus one commit. µs per call:
CYCLED_CALLS calls cycling over distinct weight copies in one CUDA graph.

    PYTHONPATH=server python benchmarks/fp8_tune.py [--rows 16] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import triton
from ddtree.bench.timing import CYCLED_CALLS, cycled_us, weight_copies
from ddtree.kernels.fp8 import Fp8Weight, quantize_weight
from ddtree.kernels.gemm import launch_config, skinny_fp8, skinny_linear
from ddtree.kernels.rows import quantize as quantize_rows

# name: (N, K, calls per round) for the Qwen3-8B-DFlash-b16 draft (5 layers) with a 16384-token draft vocabulary
DRAFT = {"q": (4096, 4096, 5), "kv": (2048, 4096, 5), "o": (4096, 4096, 5), "gate_up": (24576, 4096, 5),
         "down": (4096, 12288, 5), "lm_head_16k": (16384, 4096, 1), "fc": (4096, 20480, 1),
         "context_kv": (10240, 4096, 1)}
QUANT_CALLS = {4096: 3 * 5 + 2, 12288: 5, 20480: 1}  # row quantisations per round by width, unfused


def fp8_linear(x8: tuple[torch.Tensor, torch.Tensor], w8: Fp8Weight, cfg: dict) -> torch.Tensor:
    return skinny_fp8(*x8, w8, torch.bfloat16, cfg)


def configs(k: int, quick: bool) -> list[dict]:
    grid = itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (4,) if quick else (4, 8), (3, 4))
    return [dict(block_n=n, block_k=bk, split_k=s, num_warps=w, num_stages=st)
            for n, bk, s, w, st in grid if k % (s * bk) == 0 and k // s >= 2 * bk]


def probe(name: str, n: int, k: int, rows: int, quick: bool) -> tuple[float, float]:
    dense = weight_copies(n, k)
    quantized = [quantize_weight(w) for w in dense]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x8 = quantize_rows(x)
    bf16 = cycled_us(lambda w: skinny_linear(x, w), dense)
    w8 = quantized[0]
    want = (x8[0].float() * x8[1][:, None]) @ (w8.data.float() * w8.scale[:, None]).T
    exact = x.float() @ dense[0].float().T
    tried = []
    for cfg in configs(k, quick):
        try:
            got = fp8_linear(x8, quantized[0], cfg).float()
        except triton.runtime.errors.OutOfResources:
            continue
        err = ((got - want).norm() / want.norm()).item()
        if err > 1e-2:
            print(f"| {name} | {rows} | {cfg} | WRONG {err:.3g} | | |", flush=True)
            continue
        tried.append((cycled_us(lambda w, cfg=cfg: fp8_linear(x8, w, cfg), quantized), err, cfg))
    tried.sort(key=lambda t: t[0])
    quant_err = ((want - exact).norm() / exact.norm()).item()
    print(f"| {name} | {rows} | bf16 skinny {launch_config(n, k)} | {bf16:.1f} | {n * k * 2 / bf16 / 1e6:.2f} | |")
    for us, err, cfg in tried[:4]:
        print(f"| {name} | {rows} | fp8 {cfg} | {us:.1f} | {n * k / us / 1e6:.2f} | {err:.1e} (vs bf16 "
              f"{quant_err:.3f}) |", flush=True)
    del dense, quantized
    torch.cuda.empty_cache()
    return bf16, tried[0][0] if tried else float("nan")


def _warm(job: tuple[int, int, dict]) -> None:
    """Compile one (rows, K, config) into Triton's disk cache, in a worker process."""
    rows, k, cfg = job
    x8 = quantize_rows(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
    w8 = quantize_weight(torch.randn(2 * cfg["block_n"], k, device="cuda", dtype=torch.bfloat16))
    with contextlib.suppress(triton.runtime.errors.OutOfResources):
        fp8_linear(x8, w8, cfg)


def precompile(jobs: list[tuple[int, int, dict]]) -> None:
    workers = min(16, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_warm, jobs, chunksize=4))
    print(f"(compiled {len(jobs)} kernels in {workers} processes)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    widths = sorted({k for _, k, _ in DRAFT.values()})
    precompile([(args.rows, k, cfg) for k in widths for cfg in configs(k, args.quick)])
    print("| proj | rows | variant | us | TB/s (own bytes) | rel. error vs dequantised fp32 |")
    print("|---|---|---|---|---|---|")
    total_bf16 = total_fp8 = 0.0
    for name, (n, k, calls) in DRAFT.items():
        with contextlib.suppress(torch.cuda.OutOfMemoryError):
            bf16, fp8 = probe(name, n, k, args.rows, args.quick)
            total_bf16 += calls * bf16
            total_fp8 += calls * fp8
    quant = 0.0
    for k, calls in QUANT_CALLS.items():
        xs = [torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(CYCLED_CALLS)]
        us = cycled_us(quantize_rows, xs)
        print(f"quantize {args.rows} x {k}: {us:.2f} us per call, {calls} calls per round")
        quant += calls * us
    print(f"\none round's draft + commit projections at {args.rows} rows: bf16 skinny {total_bf16 / 1e3:.3f} ms, "
          f"fp8 best {total_fp8 / 1e3:.3f} ms, + unfused row quantisation {quant / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
