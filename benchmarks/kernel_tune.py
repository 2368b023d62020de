"""Fast-path kernels on a GPU: tree attention launch configurations, and the tree build's selection ops.

1. Tree attention: the Triton split-K kernel under several launch configurations vs SDPA.

For the row counts the fast path meets on a Qwen3-8B-shaped target (8 K/V heads, 4 query heads each, d 128):
one AR row, a 16-row draft block, and 65- and 129-node tree verifies (4, 64, 260 and 516 grouped query rows),
at a 560-token context in a 768-row cache (--context: another, e.g. a prefix hit's 1650 cached tokens). Each
variant is checked against SDPA, then runs over 36 distinct layer caches (more than L2 holds) as one CUDA graph;
the time is per layer call, median of replays.
--sweep tries, for the AR row, 1 to 32 splits; for the draft block and the trees, at most 54 configs in two
stages: tile height x warps x splits (1/2/3/4/6/8/12/16) at block_n 64 and 2 pipeline stages, then block_n
32/64/128 x num_stages 1/2/3 around the 3 fastest of those. splits 1 is the kernel without the merge pass;
the trees' configs take the kernel's two-loop form (committed keys without visibility reads), the AR row's
one loop. The last table is the fastest config per row count.
2. Tree build: `top_prefixes` at each budget over the demo's 8192-token and Qwen3's 151936-token vocabulary,
   and its parts: the vocabulary top-k + log-partition (Triton vs torch) and the tree kernel at 4/8/16 warps.
   --sweep adds the vocabulary top-k's chunk width (1024..16384) x warps (4/8/16) at 151936 tokens, each
   checked against the default launch's tokens.

    PYTHONPATH=server python benchmarks/kernel_tune.py [--sweep] [--part tree|attention] [--rows 4 64 260 516]
        # --sweep: launch configs; --part: only one of the two parts; --rows: only these row counts
        # --warps 8: the sweep tries only the 8-warp tiles; --heads 4 6 256: another head layout
        # --new-split: the trees' loop forms (the new rows' keys in a split of their own or not)
"""

from __future__ import annotations

import argparse

import torch
from ddtree.bench.timing import graph_ms
from ddtree.kernels.attention import TreeMask, _triton_attention, launch_config, tree_attention, tree_mask
from triton.runtime.errors import OutOfResources

LAYERS, KV, GROUPS, D, CAPACITY, START = 36, 8, 4, 128, 768, 560
TREE_SHAPES = ((16, 4), (16, 8), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8))  # (block_m, num_warps)
TREE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
PIPELINES = tuple((block_n, stages) for block_n in (32, 64, 128) for stages in (1, 2, 3))
REFINED = 3  # stage-1 configs whose block_n and num_stages the sweep varies
AR_ROWS = 16  # up to this many rows (one AR token's heads), the sweep varies only the splits
SDPA = "sdpa (cuDNN), whole capacity"


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


def config(block_m: int, num_warps: int, splits: int, block_n: int = 64, num_stages: int = 2,
           two_loops: int = 1) -> dict[str, int]:
    return dict(block_m=block_m, block_n=block_n, splits=splits, num_warps=num_warps, num_stages=num_stages,
                two_loops=two_loops)


def shape_grid(rows: int, warps: list[int] | None = None) -> list[dict[str, int]]:
    """Sweep stage 1. One AR row only fills the GPU through splits; more rows also vary the tile height,
    up to twice the rows (taller tiles only compute padding); `warps` keeps only tiles with those warps."""
    if rows <= AR_ROWS:
        return [config(16, 4, splits, two_loops=0) for splits in (1, 2, 4, 8, 16, 32)]
    return [config(bm, nw, splits) for bm, nw in TREE_SHAPES
            if bm <= 2 * rows and (warps is None or nw in warps) for splits in TREE_SPLITS]


def pipeline_grid(fastest: list[dict[str, int]]) -> list[dict[str, int]]:
    """Sweep stage 2: key block and pipeline depth matter through shared memory and latency hiding, which
    depend on the tile, so they are varied around the fastest tiles rather than crossed with every one."""
    return [{**cfg, "block_n": block_n, "num_stages": stages} for cfg in fastest for block_n, stages in PIPELINES]


NEW_SPLITS = (2, 3, 4, 5, 6)
NEW_PIPELINES = ((64, 2), (64, 3), (32, 3))  # (block_n, num_stages)


def new_split_grid(default: dict[str, int]) -> list[dict[str, int]]:
    """The trees' loop forms around `default`'s tile: the new rows' keys in the split that also ends the
    committed keys (two_loops 1) or in a split of their own (two_loops 2), over 2-6 splits and three pipelines."""
    return [{**default, "splits": splits, "block_n": block_n, "num_stages": stages, "two_loops": form}
            for form in (1, 2) for splits in NEW_SPLITS for block_n, stages in NEW_PIPELINES]


def check_and_time(q: torch.Tensor, caches: list[torch.Tensor], fast: TreeMask, want: torch.Tensor,
                   cfg: dict[str, int]) -> float | str:
    """µs per layer call with `cfg`, or why it is not timed: an output that is not SDPA's, or a launch the GPU
    lacks shared memory or registers for (a swept tile need not fit)."""
    try:
        got = _triton_attention(q, caches[0], fast, cfg).float()
    except OutOfResources as exc:
        return f"skipped: {exc}"
    if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
        return f"WRONG ({(got - want).abs().max():.3g})"
    return per_call_us(layer_calls(q, caches, fast, cfg))


def row_count(rows: int, caches: list[torch.Tensor], start: torch.Tensor, sms: int,
              sweep: bool, warps: list[int] | None,
              new_split: bool = False) -> tuple[dict[str, int], dict[str, float | str]]:
    """The default config for `rows` grouped query rows (a causal block of rows // GROUPS tokens), and every
    variant tried: name -> µs per layer call, or why it was not timed."""
    dev, n = start.device, rows // GROUPS
    q = torch.randn(KV, rows, D, device=dev, dtype=torch.bfloat16)
    visible = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    fast = tree_mask(start, visible, CAPACITY, GROUPS, D, torch.bfloat16)
    slow = tree_mask(start.cpu(), visible.cpu(), CAPACITY, GROUPS, D, torch.bfloat16)
    sdpa = TreeMask(start, n, None, additive=slow.additive.to(dev))
    want = tree_attention(q, caches[0], sdpa).float()
    default = launch_config(rows, CAPACITY, KV, sms, D)
    results: dict[str, float | str] = {SDPA: per_call_us(layer_calls(q, caches, sdpa, None))}

    def measure(configs: list[dict[str, int]]) -> None:
        for cfg in configs:
            if str(cfg) not in results:
                results[str(cfg)] = check_and_time(q, caches, fast, want, cfg)

    grid = shape_grid(rows, warps) if sweep else []
    if new_split and rows > AR_ROWS:
        grid += new_split_grid(default)
    measure([default, *grid])
    if sweep and rows > AR_ROWS:
        fastest = sorted((c for c in grid if isinstance(results[str(c)], float)), key=lambda c: results[str(c)])
        measure(pipeline_grid(fastest[:REFINED]))
    return default, results


def attention(sweep: bool, row_counts: list[int], warps: list[int] | None, new_split: bool = False) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    caches = [torch.randn(2, KV, CAPACITY, D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    start = torch.tensor(START, device=dev)
    fastest = []
    print("| rows | variant | us per layer |\n|---|---|---|")
    for rows in row_counts:
        default, results = row_count(rows, caches, start, sms, sweep, warps, new_split)
        timed = sorted((us, name) for name, us in results.items() if isinstance(us, float))
        for us, name in timed:
            print(f"| {rows} | {'default ' if name == str(default) else ''}{name} | {us:.1f} |")
        for name, why in results.items():
            if isinstance(why, str):
                print(f"| {rows} | {name} | {why} |")
        kernel = next(((us, name) for us, name in timed if name != SDPA), (float("nan"), "none ran"))
        fastest.append((rows, kernel, results[SDPA], results[str(default)]))
    print("\n| rows | fastest config | us per layer | default us | sdpa us |\n|---|---|---|---|---|")
    for rows, (us, name), sdpa_us, default_us in fastest:
        shown = f"{default_us:.1f}" if isinstance(default_us, float) else default_us
        print(f"| {rows} | {name} | {us:.1f} | {shown} | {sdpa_us:.1f} |")


def tree_ops(sweep: bool) -> None:
    dev = torch.device("cuda")
    print("\n| vocab | budget | what | us per call |\n|---|---|---|---|")
    for vocab in (8192, 151936):
        logits = torch.randn(15, vocab, device=dev, dtype=torch.bfloat16) * 4
        for budget in (16, 32, 64, 128):
            tree_phase(logits, budget)
    if sweep:
        vocab_top_sweep(logits)


def vocab_top_sweep(logits: torch.Tensor) -> None:
    """The vocabulary top-k + log-partition at each chunk width and warp count; tokens against the default's."""
    from ddtree.kernels import tree

    width, warps_of = tree._chunk_width, tree._chunk_warps
    print("\n| k | chunk | warps | us per call | tokens as the default's |\n|---|---|---|---|---|")
    for k in (16, 32, 64, 128):
        want = tree._vocab_top_on_gpu(logits, k)[1]
        default = width(logits.shape[1], k)
        us = per_call_us(lambda k=k: [tree._vocab_top_on_gpu(logits, k) for _ in range(LAYERS)])
        print(f"| {k} | {default} (default) | {warps_of(default, True)} | {us:.1f} | yes |")
        for chunk in (c for c in (1024, 2048, 4096, 8192, 16384) if c >= k):
            for warps in (4, 8, 16):
                tree._chunk_width, tree._chunk_warps = (lambda *_, c=chunk: c), (lambda *_, w=warps: w)
                try:
                    same = torch.equal(tree._vocab_top_on_gpu(logits, k)[1], want)
                    us = per_call_us(lambda k=k: [tree._vocab_top_on_gpu(logits, k) for _ in range(LAYERS)])
                    print(f"| {k} | {chunk} | {warps} | {us:.1f} | {'yes' if same else 'NO'} |")
                except OutOfResources:
                    print(f"| {k} | {chunk} | {warps} | out of resources | |")
                finally:
                    tree._chunk_width, tree._chunk_warps = width, warps_of


def tree_phase(logits: torch.Tensor, budget: int) -> None:
    """Print the tree phase's cost for one vocabulary and budget, whole and by part."""
    from ddtree.kernels import tree

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
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 64, 260, 516],
                        help="grouped query rows (GROUPS x new tokens) for the attention part")
    parser.add_argument("--warps", type=int, nargs="+", help="sweep only the tree tiles with these warps")
    parser.add_argument("--new-split", action="store_true",
                        help="time the trees' loop forms (new_split_grid) around the default tile")
    parser.add_argument("--heads", type=int, nargs=3, metavar=("KV", "GROUPS", "D"), default=[KV, GROUPS, D],
                        help="K/V heads, query heads per K/V head, head dim (Qwen3.6-27B: 4 6 256)")
    parser.add_argument("--context", type=int, default=START,
                        help="committed tokens before the new rows (a prefix hit's prompt rows: 1650)")
    args = parser.parse_args()
    KV, GROUPS, D = args.heads
    START = args.context
    CAPACITY = max(CAPACITY, START + max(args.rows) // GROUPS + 64)
    if args.part != "attention":
        tree_ops(args.sweep)
    if args.part != "tree":
        attention(args.sweep, args.rows, args.warps, args.new_split)
