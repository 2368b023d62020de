"""Top-p without top-k: the vocabulary sort that `filter_logits` runs against a sort-free bisection.

On the 8B shape a top-p-only request adds 1.43 ms to a B = 64 round, most of it `torch.sort` over 65 rows
of 151936 logits (benchmarks/RESULTS.md, v5). The kept set only needs the threshold T: the smallest logit
v of the row such that the probability mass strictly above v is below top_p (the same set the sorted
cumulative sum keeps, ties with the last kept token included). Bisecting T over the float32 values'
ordered bit patterns takes 33 masked sums per row and no sort. This script checks that both keep the same
tokens and times both, each replayed as a CUDA graph, before the product adopts either. The two sum the
probabilities in different orders, so a row whose mass meets top_p within float32 rounding can keep one
token more or less under the other (on a 2-core CPU: 1 row of 32 at top_p 0.97 with a mass of 0.96999997).

    PYTHONPATH=server python benchmarks/topp_tune.py [--rows 65] [--vocab 151936]
"""

from __future__ import annotations

import argparse

import torch
from ddtree.core.sampling import filter_logits


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 whose signed order is the floats' order (an involution: it also maps back)."""
    bits = x.view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def top_p_bisection(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """filter_logits(logits, 0, top_p, 0) without sorting: float32 [N, V] in, filtered entries at -inf."""
    probs = torch.softmax(logits, dim=-1)
    finite = logits.masked_fill(logits.isinf(), float("nan"))
    lo = _ordered(finite.nan_to_num(float("inf")).amin(dim=-1, keepdim=True)).long() - 1  # mass above: 1
    hi = _ordered(finite.nan_to_num(float("-inf")).amax(dim=-1, keepdim=True)).long()  # mass above: 0
    for _ in range(33):  # invariant: mass(> lo) >= top_p > mass(> hi); the int32 range needs 32 halvings
        mid = (lo + hi) // 2
        threshold = _ordered(mid.int()).view(torch.float32)
        below = torch.where(logits > threshold, probs, 0.0).sum(dim=-1, keepdim=True) < top_p
        hi, lo = torch.where(below, mid, hi), torch.where(below, lo, mid)
    return logits.masked_fill(logits < _ordered(hi.int()).view(torch.float32), float("-inf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print("| top_p | same kept sets | sort ms | bisection ms |\n|---|---|---|---|")
    for top_p in (0.5, 0.9, 0.95, 0.99):
        logits = (torch.randn(args.rows, args.vocab, generator=gen) * 3).to(args.device)
        want = filter_logits(logits, 0, top_p, 0.0).isfinite()
        got = top_p_bisection(logits, top_p).isfinite()
        same = f"{int((want == got).all(dim=-1).sum())} of {args.rows}"
        times = ["-", "-"]
        if logits.is_cuda:
            from ddtree.bench.command import graph_ms

            times = [f"{graph_ms(lambda f=f, x=logits, p=top_p: f(x, p)):.3f}" for f in (
                lambda x, p: filter_logits(x, 0, p, 0.0), top_p_bisection)]
        print(f"| {top_p} | {same} | {times[0]} | {times[1]} |", flush=True)


if __name__ == "__main__":
    main()
