"""Do the fast path's greedy tokens equal `ar`'s on a random-weight shape, and where they part, is it a tie?

Builds a shape (as `ddtree bench --shape`) in the given dtype, decodes one 512-token random prompt greedily
with fast `ar`, fast `ddtree` at budgets 32 and 64, and the eager reference path's `ar`, each with the top-2
log-probabilities of every emitted token. For each run that parts from fast `ar`, it prints the first token
where they differ and both runs' top-2 there: random weights give flat logits, and in bf16 the top two are
often a rounding step apart, so batched and one-row products may pick differently; float32 should not part.

    PYTHONPATH=server python benchmarks/parting.py --shape qwen3.6-27b --dtype float32
"""

from __future__ import annotations

import argparse

import torch
from ddtree.bench.shapes import build_shape
from ddtree.core.sampling import SamplingParams
from ddtree.engine import TokenLogprob
from ddtree.models.shapes import SHAPES


def top2(lp: TokenLogprob) -> str:
    (a, pa), (b, pb) = lp.top[:2]
    return f"{a}: {pa:.4f}, {b}: {pb:.4f} (gap {pa - pb:.4f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    fast, eager = build_shape(args.shape, torch.device("cuda"), getattr(torch, args.dtype), fast_capacity=1024)
    prompt = torch.randint(0, 150000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, logprobs=2)
    runs = {"fast ar": fast.generate(prompt, params, method="ar")}
    for budget in (32, 64):
        runs[f"fast ddtree B={budget}"] = fast.generate(prompt, params, method="ddtree", budget=budget)
    runs["eager ar"] = eager.generate(prompt, params, method="ar")
    ar = runs["fast ar"]
    for name, res in list(runs.items())[1:]:
        i = next((i for i, (a, b) in enumerate(zip(ar.token_ids, res.token_ids, strict=True)) if a != b), None)
        where = f"{args.shape} {args.dtype} {name}"
        if i is None:
            print(f"{where}: the same {len(ar.token_ids)} tokens as fast ar", flush=True)
        else:
            print(f"{where}: parts from fast ar at token {i}; its top-2 {top2(res.logprobs[i])}, fast ar's "
                  f"{top2(ar.logprobs[i])}", flush=True)


if __name__ == "__main__":
    main()
