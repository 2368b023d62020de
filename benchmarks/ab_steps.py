"""The fast path's kernel choices A/B, in one process: whole AR steps and tree rounds of the 8B shape.

Variants, alternated (each recaptures its graphs), twice over, timing the AR step and rounds at B = 16
and 64:

    all kernels      one-row GEMVs (ddtree/fast/gemv.py), the few-row GEMM (ddtree/fast/gemm.py) and the
                     attention-heads kernel (ddtree/fast/heads.py)
    cuBLAS few-row   the same with cuBLAS for every projection of more than one row
    compiled heads   one-row GEMVs, the heads step as torch.compile's kernels, cuBLAS for more rows
    v4               cuBLAS and the separate compiled kernels (what the fast path ran before the kernels)

    PYTHONPATH=server python benchmarks/ab_steps.py
"""

from __future__ import annotations

import itertools

import torch
from ddtree.fast import gemm
from ddtree.fast.bench import build_shape, run
from ddtree.fast.fused import Ops
from ddtree.fast.heads import attention_heads
from ddtree.sampling import SamplingParams


def main() -> None:
    fast, _ = build_shape("qwen3-8b", torch.device("cuda"), torch.bfloat16, fast_capacity=1024)
    path = fast.fast
    compiled = Ops(compile=True).attention_heads
    variants = {"all kernels": (True, True, attention_heads), "cuBLAS few-row": (True, False, attention_heads),
                "compiled heads": (True, False, compiled), "v4": (False, False, compiled)}
    prompts = [torch.randint(0, 150000, (512,), generator=torch.Generator().manual_seed(0)).tolist()]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    print("| variant | AR step ms | B = 16 round ms | B = 64 round ms | B = 16 draft ms |\n|---|---|---|---|---|")
    for _, (label, (row_gemv, skinny, heads)) in itertools.product(range(2), variants.items()):
        path.row_gemv, gemm.ENABLED, path.ops.attention_heads = row_gemv, skinny, heads
        path._plans.clear()  # recapture with this variant's kernels
        ar = run(fast, prompts, "ar", 1, params)["round_ms"]
        small = run(fast, prompts, "ddtree", 16, params)
        tree = run(fast, prompts, "ddtree", 64, params)["round_ms"]
        print(f"| {label} | {ar:.3f} | {small['round_ms']:.3f} | {tree:.3f} | {small['phase_ms']['draft']:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
