"""What a projection gains when its weight was prefetched into L2 during a latency-bound window before it.

A layer's attention reads little and takes ~10 µs, while the output projection after it streams 33.5 MB
(Qwen3-8B). Each timing is a CUDA graph of 36 iterations over distinct weights of: a kernel whose threads ask
L2 for a fraction of the weight with Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2.global`, what any
latency-bound kernel could issue before the projection; fraction 0 launches it with nothing to fetch), or with
`--read` a kernel that reads that fraction (torch.sum), then a sleeping kernel (the window), then the
projection. The projection's time is the iteration's minus the same iteration without it. RESULTS v30: the
bulk prefetch left the projections as slow as cold ones; a real read made them faster (RESULTS v10 tried
per-line hints and side-stream loads in whole steps).

    PYTHONPATH=server python benchmarks/l2_prefetch_probe.py [--rows 65 1] [--window-us 6 12] [--only o qkv]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from ddtree.bench.command import cycled_us, weight_copies
from ddtree.kernels import wgmma
from ddtree.kernels.gemm import linear
from ddtree.kernels.gemv import gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@triton.jit
def _prefetch_kernel(W, nbytes, THREADS: tl.constexpr):
    """Program p of P asks L2 for its share of the bytes [W, W + nbytes): one bulk prefetch per thread, each a
    multiple of 16 bytes (nbytes is). Nothing waits for them."""
    programs = tl.num_programs(0)
    chunk = tl.cdiv(tl.cdiv(nbytes, programs * THREADS), 16) * 16
    offsets = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * chunk
    sizes = tl.minimum(tl.maximum(nbytes - offsets, 0), chunk).to(tl.int32)
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
        "=r,l,r", [W.to(tl.pointer_type(tl.uint8)) + offsets, sizes], dtype=tl.int32, is_pure=False, pack=1)


def launch_prefetch(weight: torch.Tensor, fraction: float, programs: int = 132) -> None:
    """Ask L2 for the first `fraction` of the weight's bytes (a multiple of 16)."""
    nbytes = int(weight.numel() * weight.element_size() * fraction) // 16 * 16
    _prefetch_kernel[(programs,)](weight, nbytes, THREADS=128, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[65, 1])
    ap.add_argument("--window-us", type=float, nargs="*", default=[6.0, 12.0])
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--only", nargs="*", help="these projections only")
    ap.add_argument("--read", action="store_true",
                    help="warm L2 by reading the fraction with a kernel (torch.sum), not by prefetching it")
    args = ap.parse_args()
    clock_hz = 1.98e9  # an H200's SM clock at boost; the line below shows what a sleep of 10 µs takes
    x_any = torch.zeros(1, device="cuda")
    sleep_one = cycled_us(lambda _: torch.cuda._sleep(int(1e-5 * clock_hz)), [x_any])
    print(f"sleep of {int(1e-5 * clock_hz)} cycles: {sleep_one:.2f} µs (asked 10)\n")
    print("| proj | rows | window µs | fraction prefetched | iteration µs | projection µs |\n|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        if args.only and name not in args.only:
            continue
        weights = weight_copies(n, k)
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            project = (lambda w, x=x: gemv(x, w)[0]) if rows == 1 else (lambda w, x=x: linear(x, w))
            if rows > 1:
                assert wgmma.supported(x, weights[0]), "wgmma kernel not taken"
            for window in args.window_us:
                cycles = int(window * 1e-6 * clock_hz)
                for fraction in args.fractions:
                    def before(w: torch.Tensor, fraction: float = fraction, cycles: int = cycles) -> None:
                        if args.read:
                            w.view(-1)[:max(1, int(w.numel() * fraction))].sum()
                        else:
                            launch_prefetch(w, fraction)
                        torch.cuda._sleep(cycles)

                    bare = cycled_us(before, weights)
                    full = cycled_us(lambda w, before=before, project=project: (before(w), project(w)), weights)
                    print(f"| {name} | {rows} | {window:g} | {fraction:g} | {full:.2f} | {full - bare:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
