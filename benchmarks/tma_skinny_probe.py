"""Does the few-row GEMM keep up with cuBLASLt at a verify's 33-80 rows when its tiles arrive by TMA?

The few-row GEMM (ddtree/kernels/gemm.py) loads its tiles with pointer loads. At 65 rows it pads them to 128 (or,
with a tail tile, to 64 + 16) and loses to cuBLASLt's nvjet kernels by 8-17 % (RESULTS v17, v19, v21), so a
B = 64 verify keeps cuBLASLt, whose kernels cannot launch as programmatic dependents (v22, v23). This probe
times the same product with both operands loaded by the tensor memory accelerator (host-built descriptors,
Triton's pipeliner): the weight tile [BLOCK_N, BLOCK_K], the rows' tile [BLOCK_M, BLOCK_K] (rows past M
arrive as zeros) and, with TAIL, a second [TAIL, BLOCK_K] tile of rows BLOCK_M.. multiplied with the same
weight tile. Split K sums its float32 partials in a fixed order, as gemm.py does. Each timing is a CUDA graph of
36 calls cycling over distinct weights (ddtree.bench.command.cycled_us); every output is checked against torch's.
With --fp8 it times an fp8 drafter's projections instead (e4m3 rows and weights, each K tile's product added in
float32, the row and channel scales after the sum, as gemm.skinny_fp8 does), against skinny_fp8.

    PYTHONPATH=server python benchmarks/tma_skinny_probe.py [--rows 65 33 17] [--only qkv o] [--quick]
    PYTHONPATH=server python benchmarks/tma_skinny_probe.py --fp8 --rows 16
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import triton
import triton.language as tl
from ddtree.bench.command import cycled_us, grid_us, weight_copies
from ddtree.kernels.fp8 import FP8, Fp8Weight, quantize_rows
from ddtree.kernels.gemm import _counters, launch_config, linear, skinny_fp8, skinny_linear
from ddtree.kernels.jit import after_previous, pdl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36), "down": (4096, 12288, 36)}
DRAFT = {"q": (4096, 4096, 5), "kv": (2048, 4096, 5), "o": (4096, 4096, 5), "gate_up": (24576, 4096, 5),
         "down": (4096, 12288, 5), "lm_head": (16384, 4096, 1)}  # the 8B draft at 16384 draft tokens


@triton.jit
def _tma_kernel(x_desc, tail_desc, w_desc, XS, WS, Y, Part, Count, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr, SPLIT_K: tl.constexpr,
                FP8: tl.constexpr, PDL: tl.constexpr):
    """Columns pid_n * BLOCK_N.. of y for every row, over the K slice pid_k; acc is y^T (weight on the MMA's M)."""
    after_previous(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    span: tl.constexpr = K // SPLIT_K
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    tail = tl.zeros((BLOCK_N, TAIL if TAIL else 16), tl.float32)
    for k in range(pid_k * span, (pid_k + 1) * span, BLOCK_K):
        w = w_desc.load([n0, k])
        if FP8:
            acc += tl.dot(w, x_desc.load([0, k]).T)
        else:
            acc = tl.dot(w, x_desc.load([0, k]).T, acc)
        if TAIL:
            tail = tl.dot(w, tail_desc.load([BLOCK_M, k]).T, tail)
    rn = n0 + tl.arange(0, BLOCK_N)
    _finish(acc, XS, WS, Y, Part, Count, tl.arange(0, BLOCK_M), rn, M, N, pid_n, pid_k, SPLIT_K, FP8)
    if TAIL:
        _finish(tail, XS, WS, Y, Part, Count + 4096, BLOCK_M + tl.arange(0, TAIL), rn, M, N, pid_n, pid_k, SPLIT_K,
                FP8)


@triton.jit
def _finish(acc, XS, WS, Y, Part, Count, rm, rn, M, N, pid_n, pid_k, SPLIT_K: tl.constexpr, FP8: tl.constexpr):
    """Store y^T's tile, or (split K) its partial, the last of the splits summing them in order; FP8: scaled by
    (channel scale x row scale) first."""
    out_ptrs = Y + rm[None, :] * N + rn[:, None]
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    if FP8:
        scale = tl.load(WS + rn, mask=rn < N, other=0.0)[:, None] * tl.load(XS + rm, mask=rm < M, other=0.0)[None, :]
    else:
        scale = 1.0
    if SPLIT_K == 1:
        tl.store(out_ptrs, (acc * scale).to(Y.dtype.element_ty), mask=ok)
    else:
        part_ptrs = Part + rm[None, :] * N + rn[:, None]
        tl.store(part_ptrs + pid_k * M * N, acc, mask=ok)
        tl.debug_barrier()
        if tl.atomic_add(Count + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros(acc.shape, tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptrs + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, (total * scale).to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(Count + pid_n, 0)


def tma_linear(x: torch.Tensor, weight: torch.Tensor, cfg: dict, x_scale: torch.Tensor | None = None,
               w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T through _tma_kernel; cfg: block_m, tail, block_n, block_k, split_k, warps, stages.
    With the scales (e4m3 x and weight): (x @ weight^T) * x_scale[:, None] * w_scale[None, :] in bf16."""
    rows, k = x.shape
    n = weight.shape[0]
    bm, tail, bn, bk, split = cfg["block_m"], cfg["tail"], cfg["block_n"], cfg["block_k"], cfg["split_k"]
    fp8 = x_scale is not None
    y = torch.empty(rows, n, device=x.device, dtype=torch.bfloat16 if fp8 else x.dtype)
    part = torch.empty((split, rows, n) if split > 1 else (1,), device=x.device, dtype=torch.float32)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    tail_desc = TensorDescriptor.from_tensor(x, [tail or 16, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    dependent = pdl(x.device)
    _tma_kernel[(triton.cdiv(n, bn), split)](
        x_desc, tail_desc, w_desc, x_scale if fp8 else y, w_scale if fp8 else y, y, part, _counters(x.device, 8192),
        rows, n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TAIL=tail, SPLIT_K=split, FP8=fp8, PDL=dependent,
        num_warps=cfg["warps"], num_stages=cfg["stages"], launch_pdl=dependent)
    return y


def configs(rows: int, k: int, quick: bool, fp8: bool = False) -> list[dict]:
    """The grid: row tiles that cover `rows` (one power of two, or 64 and a 16-row tail), then tiles and splits
    (fp8: K tiles of 128 and 256 elements, the bf16 grid's bytes a step and twice them)."""
    shapes = [(max(16, triton.next_power_of_2(rows)), 0)]
    if rows > 64:
        shapes.append((64, 16))
    widths = (128, 256) if fp8 else (64, 128)
    grid = itertools.product(shapes, (64, 128), widths, (1, 2, 4), (4,) if quick else (4, 8), (3, 4, 5))
    return [dict(block_m=bm, tail=tail, block_n=bn, block_k=bk, split_k=s, warps=w, stages=st)
            for (bm, tail), bn, bk, s, w, st in grid if k % (s * bk) == 0 and k // s >= 2 * bk]


def _warm(job: tuple[int, int, dict, bool]) -> None:
    """Compile one config into Triton's disk cache, in a worker process."""
    rows, k, cfg, fp8 = job
    dtype = FP8 if fp8 else torch.bfloat16
    scales = (torch.ones(rows, device="cuda"), torch.ones(2 * cfg["block_n"], device="cuda")) if fp8 else (None, None)
    with contextlib.suppress(triton.runtime.errors.OutOfResources):
        tma_linear(torch.zeros(rows, k, device="cuda").to(dtype),
                   torch.zeros(2 * cfg["block_n"], k, device="cuda").to(dtype), cfg, *scales)


def probe(name: str, n: int, k: int, rows: int, quick: bool) -> tuple[float, float]:
    """Print one projection's lines; returns µs per call of (cuBLAS's route, the best TMA config)."""
    weights = weight_copies(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, weights[0]).float()
    blas = cycled_us(lambda w: linear(x, w), weights)
    print(f"| {name} | {rows} | `linear` (today's route) | {blas:.1f} |", flush=True)
    if rows <= 256:
        print(f"| {name} | {rows} | skinny {launch_config(n, k)} | "
              f"{cycled_us(lambda w: skinny_linear(x, w), weights):.1f} |", flush=True)
    return blas, best(name, rows, lambda w, cfg: tma_linear(x, w, cfg), weights, want, configs(rows, k, quick))


def probe_fp8(name: str, n: int, k: int, rows: int, quick: bool) -> tuple[float, float]:
    """One fp8 projection: skinny_fp8 against the TMA kernel's configs; returns µs of (skinny_fp8, best TMA)."""
    weights = [Fp8Weight(w.to(FP8), torch.rand(n, device="cuda") + 0.5) for w in weight_copies(n, k // 2)
               for w in [torch.cat([w, w], 1)]]
    x, x_scale = quantize_rows(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
    want = skinny_fp8(x, x_scale, weights[0], torch.bfloat16).float()
    skinny = cycled_us(lambda w: skinny_fp8(x, x_scale, w, torch.bfloat16), weights)
    print(f"| {name} | {rows} | skinny_fp8 {launch_config(n, k, fp8=True)} | {skinny:.1f} |", flush=True)
    return skinny, best(name, rows, lambda w, cfg: tma_linear(x, w.data, cfg, x_scale, w.scale), weights, want,
                        configs(rows, k, quick, fp8=True))


def best(name: str, rows: int, call: Callable[[object, dict], torch.Tensor], weights: list, want: torch.Tensor,
         grid: list[dict]) -> float:
    """Print the TMA kernel's 4 fastest configs (grid_us); returns the fastest's µs. Frees the weights."""
    timed = grid_us(call, weights, want, grid,
                    lambda cfg, err: print(f"| {name} | {rows} | TMA {cfg} | WRONG {err:.3g} |"))
    for us, cfg in timed[:4]:
        print(f"| {name} | {rows} | TMA {cfg} | {us:.1f} |", flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return timed[0][0] if timed else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[65, 33, 17])
    ap.add_argument("--only", nargs="*", help="these projections only")
    ap.add_argument("--quick", action="store_true", help="4 warps only")
    ap.add_argument("--fp8", action="store_true", help="an fp8 drafter's projections, against skinny_fp8")
    args = ap.parse_args()
    table = DRAFT if args.fp8 else SHAPES
    shapes = {name: s for name, s in table.items() if not args.only or name in args.only}
    jobs = {(rows, k, str(cfg)): cfg for rows in args.rows for _, k, _ in shapes.values()
            for cfg in configs(rows, k, args.quick, args.fp8)}
    workers = min(16, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_warm, [(rows, k, cfg, args.fp8) for (rows, k, _), cfg in jobs.items()], chunksize=4))
    print(f"(compiled {len(jobs)} kernels in {workers} processes)\n\n| proj | rows | variant | µs |\n|---|---|---|---|")
    for rows in args.rows:
        total_now = total_tma = 0.0
        for name, (n, k, calls) in shapes.items():
            now, tma = (probe_fp8 if args.fp8 else probe)(name, n, k, rows, args.quick)
            total_now += calls * now
            total_tma += calls * tma
        what = "one draft pass's projections" if args.fp8 else "one step's projections but the LM head"
        print(f"\n{rows} rows, {what}: today's route {total_now / 1e3:.3f} ms, TMA best {total_tma / 1e3:.3f} ms\n",
              flush=True)


if __name__ == "__main__":
    main()
