"""Fast-path kernels on a GPU: tree attention launch configurations, and the tree build's selection ops.

1. Tree attention: the Triton split-K kernel under several launch configurations vs SDPA.

For the row counts the fast path meets on a Qwen3-8B-shaped target (8 K/V heads, 4 query heads each, d 128):
one AR row, a 16-row draft block, and 65- and 129-node tree verifies, at a 560-token context in a
768-row cache. Each variant runs over 36 distinct layer caches (more than L2 holds) as one CUDA graph;
the time is per layer call, median of replays.
2. Tree build: `top_prefixes` at each budget over the demo's 8192-token and Qwen3's 151936-token vocabulary,
   and its parts: the vocabulary top-k + log-partition (Triton vs torch) and the tree kernel at 4/8/16 warps.

    PYTHONPATH=server python benchmarks/kernel_tune.py [--sweep] [--part tree|attention]
        # --sweep: every attention launch config; --part: only one of the two parts
"""

from __future__ import annotations

import argparse

import torch
from ddtree.fast.attention import TreeMask, _triton_attention, launch_config, tree_attention, tree_mask
from ddtree.fast.bench import graph_ms

LAYERS, KV, GROUPS, D, CAPACITY, START = 36, 8, 4, 128, 768, 560


def per_call_us(fn) -> float:
    """µs per call of `fn`, which makes LAYERS calls, replayed as one CUDA graph."""
    return 1e3 * graph_ms(fn) / LAYERS


def layer_calls(q: torch.Tensor, caches: list[torch.Tensor], mask: TreeMask, cfg: dict | None):
    """One attention call per layer cache: SDPA when cfg is None, else the Triton kernel with that config."""
    def run() -> None:
        for cache in caches:
            if cfg is None:
                tree_attention(q, cache, mask)
            else:
                _triton_attention(q, cache, mask, cfg)
    return run


def attention(sweep: bool) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    caches = [torch.randn(2, KV, CAPACITY, D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    start = torch.tensor(START, device=dev)
    print("| rows | variant | us per layer |\n|---|---|---|")
    for n in (1, 16, 65, 129):
        q = torch.randn(KV, GROUPS * n, D, device=dev, dtype=torch.bfloat16)
        visible = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        fast = tree_mask(start, visible, CAPACITY, GROUPS, D, torch.bfloat16)
        slow = tree_mask(start.cpu(), visible.cpu(), CAPACITY, GROUPS, D, torch.bfloat16)
        sdpa = TreeMask(start, n, None, additive=slow.additive.to(dev))
        want = tree_attention(q, caches[0], sdpa).float()
        base = launch_config(GROUPS * n, CAPACITY, KV, sms)
        variants = {"sdpa (cuDNN), whole capacity": None, "default " + str(base): base}
        for bm, warps in ((16, 4), (32, 4), (64, 4), (64, 8)) if sweep else ():
            if bm > max(16, 2 * GROUPS * n):
                continue
            for splits in (1, 2, 4, 8, 16, 32):
                cfg = dict(block_m=bm, block_n=64, splits=splits, num_warps=warps, num_stages=2)
                variants[str(cfg)] = cfg
        results = []
        for name, cfg in variants.items():
            if cfg is not None:
                got = _triton_attention(q, caches[0], fast, cfg).float()
                if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                    print(f"| {GROUPS * n} | {name} | WRONG ({(got - want).abs().max():.3g}) |")
                    continue
            results.append((per_call_us(layer_calls(q, caches, sdpa if cfg is None else fast, cfg)), name))
        for us, name in sorted(results)[:6] + [r for r in results if not r[1].startswith("{")]:
            print(f"| {GROUPS * n} | {name} | {us:.1f} |")


def tree_ops() -> None:
    dev = torch.device("cuda")
    print("\n| vocab | budget | what | us per call |\n|---|---|---|---|")
    for vocab in (8192, 151936):
        logits = torch.randn(15, vocab, device=dev, dtype=torch.bfloat16) * 4
        for budget in (16, 32, 64, 128):
            tree_phase(logits, budget)


def tree_phase(logits: torch.Tensor, budget: int) -> None:
    """Print the tree phase's cost for one vocabulary and budget, whole and by part."""
    from ddtree.fast import tree

    vocab, k = logits.shape[1], min(budget, logits.shape[1])

    built = (*tree.vocab_top(logits, k), tree._frontier(budget, k, logits.device), budget,
             tree.tree_size(logits.shape[0], vocab, budget))
    default = tree._tree_warps
    for warps in (4, 8, 16):
        tree._tree_warps = lambda _, warps=warps: warps
        us = per_call_us(lambda: [tree._build_on_gpu(*built) for _ in range(LAYERS)])
        print(f"| {vocab} | {budget} | tree kernel, {warps} warps | {us:.1f} |")
    tree._tree_warps = default
    rows = {"top_prefixes (the whole tree phase)": lambda: tree.top_prefixes(logits, budget),
            "vocab top-k + log-partition, Triton": lambda: tree.vocab_top(logits, k),
            "vocab top-k + log-partition, torch": lambda: tree._vocab_top_torch(logits, k)}
    for name, op in rows.items():
        us = per_call_us(lambda op=op: [op() for _ in range(LAYERS)])
        print(f"| {vocab} | {budget} | {name} | {us:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--part", choices=["tree", "attention"])
    args = parser.parse_args()
    if args.part != "attention":
        tree_ops()
    if args.part != "tree":
        attention(args.sweep)
