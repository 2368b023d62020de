"""Probe: CUTLASS's Hopper GEMM written in its Python DSL (CuTe DSL, TMA + wgmma, persistent; through the CUTLASS
Operator API) at a tree verify's 65 rows, against torch's route (cuBLASLt's nvjet kernel).

Why: v22 and v23 found that cuBLAS offers no GEMM for these rows that can launch as a programmatic dependent.
A kernel of our own in CuTe DSL could (it compiles without nvcc, even without a GPU). Before writing one: is a
CuTe DSL Hopper GEMM at these rows as fast as nvjet to begin with? Rows pad to the tile's N (64 or 128 here,
against nvjet's 72), with the weight on the MMA's M side (y^T = W x^T).

For each 8B projection: µs per call in a CUDA graph of calls cycling over distinct weights (as `blas_rows.py`),
for torch's route and each operator (tile and cluster), and each operator's largest difference from torch's.

    pip install nvidia-cutlass-dsl[cu13] nvidia-cutlass-operators
    PYTHONPATH=server:benchmarks python benchmarks/cutedsl_probe.py [--rows 65] [--only qkv o]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator

import cutlass.operators as ops
import torch
import torch.nn.functional as F
from ddtree.bench.command import CYCLED_CALLS, cycled_us, weight_copies
from skinny_tune import TARGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65)
    ap.add_argument("--only", nargs="+", default=["qkv", "o", "gate_up", "down"])
    ap.add_argument("--tiles", nargs="+", default=["64x128", "128x128", "64x64"], help="CTA tiles (M = weight rows)")
    ap.add_argument("--clusters", nargs="+", default=["1x1", "2x1"])
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), f"{args.rows} rows", flush=True)
    print("\n| projection | kernel | µs per call | max diff vs torch | compile s |\n|---|---|---|---|---|")
    for name in args.only:
        n, k, _ = TARGET[name]
        weights = weight_copies(n, k)
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        zero = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, weights[0], zero)
        torch_us = cycled_us(lambda w, x=x, zero=zero: F.linear(x, w, zero), weights)
        print(f"| {name} ({n} x {k}) | torch's route (cuBLASLt) | {torch_us:.1f} | 0 | |", flush=True)
        outs = [torch.empty(args.rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(CYCLED_CALLS)]
        calls = [ops.GemmArguments(weights[i % len(weights)], x.t(), outs[i].t(), accumulator_type=torch.float32)
                 for i in range(CYCLED_CALLS)]

        def wanted(meta: ops.OperatorMetadata) -> bool:
            design = meta.design
            tile = getattr(design, "tile_shape", None)
            cluster = getattr(design, "cluster_shape", None)
            return (tile is not None and cluster is not None and "Sm90" in meta.operator_name
                    and f"{tile[0]}x{tile[1]}" in args.tiles and f"{cluster[0]}x{cluster[1]}" in args.clusters)

        for op in ops.get_operators(calls[0], metadata_filter=wanted, target_sm="90a"):
            label = op.metadata.operator_name.split("_acc")[-1]
            try:
                start = time.time()
                artifact = op.compile(calls[0])
                compile_s = time.time() - start
                stream = torch.cuda.current_stream()
                op.run(calls[0], artifact, stream=stream, assume_supported_args=True)
                torch.cuda.synchronize()
                diff = (outs[0].float() - want.float()).abs().max().item()
                order = itertools.cycle(calls)

                def call(_w: torch.Tensor, op: ops.Operator = op, artifact: object = artifact,
                         order: Iterator = order) -> None:  # each call its own weight and output, in turn
                    op.run(next(order), artifact, stream=torch.cuda.current_stream(), assume_supported_args=True)

                us = cycled_us(call, weights)
                print(f"| {name} | {label} | {us:.1f} | {diff:.3g} | {compile_s:.1f} |", flush=True)
            except Exception as exc:  # a probe: report the operator that fails and go on
                print(f"| {name} | {label} | failed: {type(exc).__name__}: {str(exc)[:120]} | | |", flush=True)
        weights.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
