"""The host's share of a batched round (CPU only): building every request's best-first tree from its candidates,
the batch budget's choice across all of them, their visibility masks, and a hybrid target's conv windows (every
row's causal-conv taps along its own path: one numpy pass over the batch, against fast/delta.conv_sources per
request), for S requests of D draft depths.

    PYTHONPATH=server python benchmarks/batch_host.py --requests 64 --budgets 8 32
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from ddtree.core.budget import FLAT, choose_nodes
from ddtree.core.tree import DraftTree, tree_from_candidates, visibility
from ddtree.fast.delta import conv_sources
from ddtree.fast.paged_hybrid import SeqRows, conv_windows

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
    print("| budget | trees | batch budget choice | visibility | hybrid conv windows (per request) |\n"
          "|---|---|---|---|---|")
    for budget in args.budgets:
        logp, tokens = torch.topk(torch.log_softmax(logits, -1), budget, -1)
        logp, tokens = logp.double().tolist(), tokens.tolist()
        trees = [tree_from_candidates(logp[s], tokens[s], budget) for s in range(args.requests)]
        total = range(args.requests * budget + 1)
        build = timed(lambda lp=logp, tk=tokens, b=budget: [tree_from_candidates(lp[s], tk[s], b)
                                                            for s in range(args.requests)], args.repeats)
        choose = timed(lambda ts=trees, tt=total: choose_nodes([t.scores for t in ts], FLAT, tt), args.repeats)
        masks = timed(lambda ts=trees: [visibility(t) for t in ts], args.repeats)
        seqs = seq_rows(trees)
        windows = timed(lambda ss=seqs: conv_windows(ss, CONV_WIDTH), args.repeats)
        per_request = timed(lambda ss=seqs: [conv_sources(s.visible, torch.from_numpy(s.depths), CONV_WIDTH)
                                             for s in ss], args.repeats)
        print(f"| {budget} | {build:.2f} | {choose:.2f} | {masks:.2f} | {windows:.2f} ({per_request:.2f}) |")


def seq_rows(trees: list[DraftTree]) -> list[SeqRows]:
    """The trees' rows as a hybrid verify lays them out: each request's root and nodes, one after another."""
    out, lo = [], 0
    for tree in trees:
        n = tree.size + 1
        out.append(SeqRows(0, lo, lo + n, visibility(tree), np.array(tree.parents), np.array([0, *tree.depths])))
        lo += n
    return out


if __name__ == "__main__":
    main()
