"""An fp8 AR step's projections (issue 53): the launches the fast path ran before `gemm.few_rows_fp8` against it, at
1, 2, 4 and 8 rows, on the Qwen3-8B, Qwen3.6-27B and Qwen3-30B-A3B shapes' widths; and the MoE's fp8 experts.

Before, a projection whose rows were not quantized yet ran the row quantization kernel (rows.quantize; down:
the quantizing SiLU · up kernel, rows.silu_mul_fp8) and then the few-row GEMM (`skinny_fp8`); rows a quantizing
norm wrote ("quantized") ran the GEMM alone. Now each is one launch of `few_rows_fp8`, which quantizes the rows and
reads its first weight tile before its PDL wait. "new 2x splits" is the same kernel with twice the K splits where
K allows (other float32 sums, so not what the fast path runs): whether more programs would pay. Every line says
whether new and old gave the same bits (they must: a row's bits are the GEMM's at any row count).

µs per call: CYCLED_CALLS calls cycling over distinct weight copies (over 1 GiB, so memory, not L2) in one CUDA
graph, so consecutive launches overlap as the fast path's do (PDL on Hopper). GB/s: the weight's bytes (values and
scales) per call; floor: those bytes at the measured copy bandwidth, ratio = time /
floor. The experts: `Experts.routed_by_kernels` (router, route, gate/up, down, combine) on rows that pick
different experts each call; their floor is the bytes of the experts the rows picked.

    PYTHONPATH=server python benchmarks/fp8_kernels.py [--formats blocks channel] [--rows 1 2 4 8]

Block scales (the published checkpoints' 128 x 128, what `ddtree bench --shape S --quantization fp8` builds) by
default; `--formats channel` adds `--quantization fp8` on a bf16 checkpoint's per-channel scales. Stops timing
new lines after --budget-s seconds (default 150) and says what it left out.
"""

from __future__ import annotations

import argparse
import time

import torch
from ddtree.bench.timing import CYCLED_CALLS, SPEC_BANDWIDTH, copy_bandwidth, cycled_us
from ddtree.kernels import gemm, rows
from ddtree.kernels.fp8 import Fp8Weight, QuantizedRows, quantize_blocks, quantize_weight
from ddtree.kernels.moe import Experts

# shape: [(projection, N, K, its input)] at one layer: "quantized" by the norm before, "rows" in bf16 (o, out_proj),
# "silu" (down: SiLU · up of the gate/up output)
SHAPES = {
    "qwen3-8b": [("qkv", 6144, 4096, "quantized"), ("o", 4096, 4096, "rows"), ("gate_up", 24576, 4096, "quantized"),
                 ("down", 4096, 12288, "silu")],
    "qwen3.6-27b": [("attn qkv+gate", 14336, 5120, "quantized"), ("attn o", 5120, 6144, "rows"),
                    ("gdn qkvz", 16384, 5120, "rows"), ("gdn out", 5120, 6144, "rows"),
                    ("gate_up", 34816, 5120, "quantized"), ("down", 5120, 17408, "silu")],
    "qwen3-30b-a3b": [("qkv", 5120, 2048, "quantized"), ("o", 2048, 4096, "rows")],
}
EXPERTS = dict(hidden=2048, inter=768, experts=128, top_k=8)  # Qwen3-30B-A3B


def fp8_copies(n: int, k: int, blocks: bool) -> list[Fp8Weight]:
    """Distinct random fp8 weights [n, k] (over 1 GiB in all, 2 to CYCLED_CALLS of them)."""
    copies = max(2, min(CYCLED_CALLS, -(-2**30 // (n * k))))
    make = quantize_blocks if blocks else quantize_weight
    return [make(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]


def old_call(kind: str, x: torch.Tensor, group: int | None):
    """The fast path's launches before few_rows_fp8 for input `kind`, as a function of the weight."""
    if kind == "quantized":
        values, scale = rows.quantize(x, group)
        return lambda w: gemm.skinny_fp8(values, scale, w, x.dtype)
    if kind == "silu":
        return lambda w: gemm.skinny_fp8(*_quantized(rows.silu_mul_fp8(x, group)), w, x.dtype)
    return lambda w: gemm.skinny_fp8(*rows.quantize(x, group), w, x.dtype)


def _quantized(q) -> tuple[torch.Tensor, torch.Tensor]:
    return q.values, q.scale


def new_call(kind: str, x: torch.Tensor, group: int | None, config: dict | None = None):
    """few_rows_fp8 for input `kind` (with `config`, other splits), as a function of the weight."""
    if kind == "quantized":
        given = QuantizedRows(*rows.quantize(x, group), x.dtype, group)
        return lambda w: gemm.few_rows_fp8(given, w, config=config)
    return lambda w: gemm.few_rows_fp8(x, w, silu=kind == "silu", config=config)


def more_splits(w: Fp8Weight) -> dict | None:
    """launch_config with twice the K splits, or None where K does not divide into them."""
    n, k = w.shape
    cfg = gemm.launch_config(n, k, fp8=True, scale_block=w.block[1] if w.block else None)
    split = 2 * cfg["split_k"]
    return dict(cfg, split_k=split) if k % (split * cfg["block_k"]) == 0 else None


def line(label: str, us: float, nbytes: int, copy: float) -> str:
    floor = 1e6 * nbytes / copy
    return f"{label:<16} {us:8.2f} us {nbytes / us / 1e3:7.0f} GB/s  {us / floor:5.2f}x floor ({floor:.2f} us)"


def projections(shapes: list[str], formats: list[str], row_counts: list[int], copy: float, deadline: float) -> None:
    for shape in shapes:
        for fmt in formats:
            blocks = fmt == "blocks"
            group = 128 if blocks else None
            for name, n, k, kind in SHAPES[shape]:
                if time.monotonic() > deadline:
                    print(f"  (time budget spent: {shape} {name} {fmt} left out)", flush=True)
                    continue
                weights = fp8_copies(n, k, blocks)
                nbytes = weights[0].nbytes
                for m in row_counts:
                    width = 2 * k if kind == "silu" else k
                    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16) * 3
                    old, new = old_call(kind, x, group), new_call(kind, x, group)
                    same = torch.equal(old(weights[0]), new(weights[0]))
                    print(f"{shape} {name} [{n}x{k}] {fmt}, {kind} input, {m} row(s): bits "
                          f"{'same' if same else 'DIFFERENT'}", flush=True)
                    print("  " + line("old", cycled_us(old, weights), nbytes, copy), flush=True)
                    print("  " + line("new", cycled_us(new, weights), nbytes, copy), flush=True)
                    cfg = more_splits(weights[0])
                    if cfg is not None and m == 1:
                        split = new_call(kind, x, group, cfg)
                        print("  " + line(f"new {cfg['split_k']} splits", cycled_us(split, weights), nbytes, copy),
                              flush=True)
                del weights
                torch.cuda.empty_cache()


def experts(formats: list[str], row_counts: list[int], copy: float) -> None:
    """The MoE's fp8 experts at one layer (router to combine), against the bytes of the experts the rows pick."""
    h, inter, count, top_k = EXPERTS["hidden"], EXPERTS["inter"], EXPERTS["experts"], EXPERTS["top_k"]
    router = torch.randn(count, h, device="cuda", dtype=torch.bfloat16) / 16
    for fmt in formats:
        blocks = fmt == "blocks"
        make = quantize_blocks if blocks else quantize_weight

        def stacked(n: int, k: int, make=make) -> Fp8Weight:
            parts = [make(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(count)]
            return Fp8Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]),
                             parts[0].block)

        block = Experts(router, stacked(2 * inter, h), stacked(h, inter), top_k, True)
        per_expert = (block.gate_up.nbytes + block.down.nbytes) // count
        for m in row_counts:
            rows_in = [torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for _ in range(CYCLED_CALLS)]
            picked = sum(torch.topk(x @ router.T, top_k).indices.unique().numel() for x in rows_in) / len(rows_in)
            nbytes = int(picked * per_expert + router.numel() * 2)
            us = cycled_us(block.routed_by_kernels, rows_in)
            print(f"qwen3-30b-a3b experts {fmt}, {m} row(s), {picked:.1f} experts picked", flush=True)
            print("  " + line("current", us, nbytes, copy), flush=True)
        del block
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=["blocks"], choices=["blocks", "channel"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("needs a CUDA device with fp8 tensor cores (compute capability 8.9+)")
    start = time.monotonic()
    copy = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: measured copy {copy / 1e12:.2f} TB/s (datasheet "
          f"{SPEC_BANDWIDTH / 1e12:.2f})", flush=True)
    experts(args.formats, args.rows, copy)
    projections(args.shapes, args.formats, args.rows, copy, start + args.budget_s)
    print(f"done in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
