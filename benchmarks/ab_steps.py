"""The fast path's kernel choices A/B, in one process: whole AR steps and B = 64 rounds of the 8B shape.

Variants, alternated (each recaptures its graphs), twice over:

    all kernels      one-row GEMVs (ddtree/fast/gemv.py) + the attention-heads kernel (ddtree/fast/heads.py)
    compiled heads   one-row GEMVs, the heads step as torch.compile's kernels
    v4               cuBLAS and the separate compiled kernels (what the fast path ran before both)

    PYTHONPATH=server python benchmarks/ab_steps.py
"""

from __future__ import annotations

import itertools

import torch
from ddtree.fast.bench import build_shape, run
from ddtree.fast.fused import Ops
from ddtree.fast.heads import attention_heads
from ddtree.sampling import SamplingParams


def main() -> None:
    fast, _ = build_shape("qwen3-8b", torch.device("cuda"), torch.bfloat16, fast_capacity=1024)
    path = fast.fast
    compiled = Ops(compile=True).attention_heads
    variants = {"all kernels": (True, attention_heads), "compiled heads": (True, compiled), "v4": (False, compiled)}
    prompts = [torch.randint(0, 150000, (512,), generator=torch.Generator().manual_seed(0)).tolist()]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    print("| variant | AR step ms | B = 64 round ms |\n|---|---|---|")
    for _, (label, (row_gemv, heads)) in itertools.product(range(2), variants.items()):
        path.row_gemv, path.ops.attention_heads = row_gemv, heads
        path._plans.clear()  # recapture with this variant's kernels
        ar = run(fast, prompts, "ar", 1, params)["round_ms"]
        tree = run(fast, prompts, "ddtree", 64, params)["round_ms"]
        print(f"| {label} | {ar:.3f} | {tree:.3f} |", flush=True)


if __name__ == "__main__":
    main()
