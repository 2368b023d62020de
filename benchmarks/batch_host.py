"""The host's share of a batched round (CPU only), as fast/batch.py runs it: every request's best-first tree from
its draft logits in one call (fast/batch_trees.dflash_trees), the batch budget's choice across all of them, their
visibility masks (one pass), and a hybrid target's conv windows (every row's causal-conv taps along its own path:
one numpy pass over the batch, against fast/delta.conv_sources per request), for S requests of D draft depths.

    PYTHONPATH=server python benchmarks/batch_host.py --requests 64 --budgets 8 32
"""

from __future__ import annotations

import argparse
import time

import torch
from ddtree.core.budget import FLAT, choose_nodes
from ddtree.fast.batch_trees import RoundTrees, dflash_trees
from ddtree.fast.delta import conv_sources
from ddtree.fast.paged_hybrid import SeqRows, conv_windows
from ddtree.kernels.tree import vocab_top

CONV_WIDTH = 4  # Qwen3.5 / Qwen3.6's Gated DeltaNet conv kernel


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--depth", type=int, default=15, help="draft positions a block proposes")
    ap.add_argument("--vocab", type=int, default=9496)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.requests, args.depth, args.vocab) * 3
    print(f"{args.requests} requests, depth {args.depth}, median of {args.repeats} (ms)")
    print("| budget | top-k and trees | of which the top-k | batch budget choice | visibility | hybrid conv windows "
          "(per request) |\n|---|---|---|---|---|---|")
    for budget in args.budgets:
        def build(b: int = budget) -> RoundTrees:
            return dflash_trees(logits, ["ddtree"] * args.requests, [b] * args.requests, [args.depth] * args.requests,
                                None)

        trees = build()
        total = range(int(trees.sizes.sum()) + 1)
        built = timed(build, args.repeats)
        top = timed(lambda b=budget: vocab_top(logits.view(-1, args.vocab), b), args.repeats)
        choose = timed(lambda ts=trees, tt=total: choose_nodes(ts.live_scores(), FLAT, tt), args.repeats)
        masks = timed(trees.visibility, args.repeats)
        seqs = seq_rows(trees)
        windows = timed(lambda ss=seqs: conv_windows(ss, CONV_WIDTH), args.repeats)
        per_request = timed(lambda ss=seqs: [conv_sources(s.visible, torch.from_numpy(s.depths), CONV_WIDTH)
                                             for s in ss], args.repeats)
        print(f"| {budget} | {built:.2f} | {top:.2f} | {choose:.2f} | {masks:.2f} | {windows:.2f} "
              f"({per_request:.2f}) |")


def seq_rows(trees: RoundTrees) -> list[SeqRows]:
    """The trees' rows as a hybrid verify lays them out: each request's root and nodes, one after another."""
    out, lo = [], 0
    for r, visible in enumerate(trees.visibility()[0]):
        parents, depths = trees.lineage(r)
        out.append(SeqRows(0, lo, lo + len(parents), visible, parents, depths))
        lo += len(parents)
    return out


if __name__ == "__main__":
    main()
