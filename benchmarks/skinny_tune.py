"""Few-row projections on a GPU: cuBLAS against the fast path's skinny GEMM (ddtree/kernels/gemm.py).

For each projection of the Qwen3-8B target at a verify's row counts (17: B = 16; 65: B = 64; 129:
B = 128), and of its DFlash-b16 draft at a block's 16 rows, the table gives µs per call of cuBLAS (and of
cuBLASLt, by way of `linear`, at the rows it takes), of the skinny kernel at its default launch config, and
of the best few configs of a grid, with the bandwidth reached (weight bytes / time). Each timing is a CUDA
graph of 36 calls cycling over distinct weight copies (more bytes than L2 holds), median of replays. Then
the sums over one step's calls (cuBLAS: the faster of cuBLAS and cuBLASLt).

    PYTHONPATH=server python benchmarks/skinny_tune.py [--quick] [--target-rows 65 33] [--only qkv o down]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.nn.functional as F
import triton
from ddtree.bench.timing import cycled_us, grid_us, weight_copies
from ddtree.kernels.gemm import LT_MAX_ROWS, MAX_ROWS, launch_config, linear, skinny_linear

# name: (N, K, calls per step)
TARGET = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36),
          "down": (4096, 12288, 36), "lm_head": (151936, 4096, 1)}
DRAFT = {"q": (4096, 4096, 5), "o": (4096, 4096, 5), "gate_up": (24576, 4096, 5), "down": (4096, 12288, 5),
         "lm_head": (151936, 4096, 1), "fc": (4096, 20480, 1), "context_kv": (10240, 4096, 1)}


GRID = {"block_n": (32, 64, 128), "num_warps": (4, 8)}  # --block-n and --warps replace these


def configs(k: int, quick: bool) -> list[dict]:
    grid = itertools.product(GRID["block_n"], (64, 128), (1, 2, 4, 8), (4,) if quick else GRID["num_warps"], (3, 4))
    return [dict(block_n=n, block_k=bk, split_k=s, num_warps=w, num_stages=st) for n, bk, s, w, st in grid
            if k % (s * bk) == 0 and k // s >= 2 * bk]


def _warm(job: tuple[int, int, dict]) -> None:
    """Compile one (rows, K, config) into Triton's disk cache, in a worker process."""
    rows, k, cfg = job
    x = torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(2 * cfg["block_n"], k, device="cuda", dtype=torch.bfloat16)
    with contextlib.suppress(triton.runtime.errors.OutOfResources):
        skinny_linear(x, w, cfg)


def precompile(jobs: list[tuple[int, int, dict]]) -> None:
    """Triton compiles one kernel at a time; compile the grid in parallel processes first (the timing loop then
    loads each from the disk cache)."""
    workers = min(16, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_warm, jobs, chunksize=4))
    print(f"(compiled {len(jobs)} kernels in {workers} processes)", flush=True)


def tune(name: str, n: int, k: int, rows: int, quick: bool) -> tuple[float, float, float]:
    """Print one projection's lines; returns µs per call of (cuBLAS, skinny default, skinny best)."""
    nbytes = n * k * 2
    weights = weight_copies(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    cublas = cycled_us(lambda w: F.linear(x, w), weights)
    lt = cycled_us(lambda w: linear(x, w), weights) if MAX_ROWS < rows <= LT_MAX_ROWS else None
    want = F.linear(x, weights[0]).float()
    default = cycled_us(lambda w: skinny_linear(x, w), weights)
    tried = grid_us(lambda w, cfg: skinny_linear(x, w, cfg), weights, want, configs(k, quick),
                    lambda cfg, err: print(f"| {name} | {rows} | {cfg} | WRONG {err:.3g} | |"))
    print(f"| {name} | {rows} | cuBLAS | {cublas:.1f} | {nbytes / cublas / 1e6:.2f} |")
    if lt is not None:
        print(f"| {name} | {rows} | cuBLASLt (`linear`) | {lt:.1f} | {nbytes / lt / 1e6:.2f} |")
        cublas = min(cublas, lt)
    print(f"| {name} | {rows} | skinny default {launch_config(n, k)} | {default:.1f} | {nbytes / default / 1e6:.2f} |")
    for us, cfg in tried[:3]:
        print(f"| {name} | {rows} | skinny {cfg} | {us:.1f} | {nbytes / us / 1e6:.2f} |", flush=True)
    del weights
    torch.cuda.empty_cache()
    return cublas, default, tried[0][0] if tried else default


def sweep(shapes: dict, rows: int, quick: bool) -> None:
    total = {"cublas": 0.0, "default": 0.0, "best": 0.0}
    for name, (n, k, calls) in shapes.items():
        for key, us in zip(total, tune(name, n, k, rows, quick), strict=True):
            total[key] += calls * us
    print(f"\n{rows} rows, one step's projections: cuBLAS {total['cublas'] / 1e3:.3f} ms, skinny default "
          f"{total['default'] / 1e3:.3f} ms, skinny best {total['best'] / 1e3:.3f} ms\n", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid (4 warps only)")
    ap.add_argument("--target-rows", type=int, nargs="*", default=[65, 17, 129])
    ap.add_argument("--draft-rows", type=int, nargs="*", default=[16])
    ap.add_argument("--only", nargs="*", help="these projections only (for example qkv o down)")
    ap.add_argument("--block-n", type=int, nargs="*", help="the grid's column tile widths (default 32 64 128)")
    ap.add_argument("--warps", type=int, nargs="*", help="the grid's warp counts (default 4 8)")
    args = ap.parse_args()
    GRID["block_n"] = tuple(args.block_n or GRID["block_n"])
    GRID["num_warps"] = tuple(args.warps or GRID["num_warps"])

    def chosen(shapes: dict) -> dict:
        return {name: shape for name, shape in shapes.items() if not args.only or name in args.only}

    sets = [(chosen(TARGET), rows) for rows in args.target_rows] + [(chosen(DRAFT), rows) for rows in args.draft_rows]
    jobs = {(rows, k, str(cfg)): cfg for shapes, rows in sets for n, k, _ in shapes.values()
            for cfg in [*configs(k, args.quick), launch_config(n, k)]}
    precompile([(rows, k, cfg) for (rows, k, _), cfg in jobs.items()])
    print("| proj | rows | variant | us | TB/s |\n|---|---|---|---|---|")
    for shapes, rows in sets:
        sweep(shapes, rows, args.quick)


if __name__ == "__main__":
    main()
