"""The fast path's kernel choices A/B, in one process: whole AR steps and tree rounds of a random-weight shape.

Variants, alternated (each recaptures its graphs), twice over, timing the AR step and rounds at B = 16
and 64 (`--budgets`); on the hybrid shape only the few-row GEMM, the one-row projections, the tree attention
and the Gated DeltaNet step change (its forward uses neither the fused GEMV layers nor the heads kernel):

    all kernels      one-row GEMVs (ddtree/kernels/gemv.py), the few-row GEMM (ddtree/kernels/gemm.py) and the
                     attention-heads kernel (ddtree/kernels/heads.py)
    no GEMV layers   the same with an AR step through the multi-row layer code (its projections still GEMVs)
    cuBLAS one-row   the same with cuBLAS for the single-row projections outside the fused GEMV layers (a
                     hybrid target's AR step, a one-row prompt's LM head)
    cuBLAS few-row   the same with cuBLAS for 2-32 rows (the skinny kernel's)
    cuBLAS many-row  the same with cuBLAS, not cuBLASLt, for 33-128 rows (a tree of 32-127 nodes)
    compiled heads   one-row GEMVs, the heads step as torch.compile's kernels, cuBLAS for more rows
    PyTorch GDN tree all kernels but a hybrid's Gated DeltaNet tree kernel (ddtree/kernels/gdn.py): its trees
                     through the compiled PyTorch steps, its AR steps still one kernel
    PyTorch GDN step neither Gated DeltaNet kernel: AR steps and trees through the compiled PyTorch steps
    v13 attention    all kernels but the tree attention as v13 launched it: one loop over every key block
                     (visibility read throughout) and v13's tiles
    no PDL           all kernels, each launched only once the kernel before it has finished (no programmatic
                     dependent launch: ddtree/kernels/jit.py)
    compiled rows    all kernels but a multi-row forward's norms and SiLU · up as torch.compile's kernels, not
                     ddtree/kernels/rows.py's
    direct trees     all kernels but trees' attention in one split of 16-row tiles (no merge kernel)
    v26 attention    all kernels but blocks of 17-1024 grouped rows read the new rows' keys in the split that also
                     ends the committed keys, at v26's tiles (not in a split of their own: ddtree/kernels/attention.py)
    separate quantization
                     all kernels but an fp8 drafter's norms and SiLU · up write their rows, and a kernel of
                     its own quantizes them (as before the norm kernels' fp8 forms; --draft-quantization fp8)
    PyTorch commit   all kernels but the commit's K/V compaction as a gather and a scatter (ddtree/kernels/cache.py)
                     and the picks as torch.argmax (not tree.vocab_argmax's two kernels)
    module RoPE      all kernels but each forward's cos and sin from the rotary modules (about eight kernels), not
                     gathered from the table filled at start (ddtree/fast/rope.py)
    PyTorch walk     all kernels but the acceptance walk as PyTorch steps (ddtree/kernels/walk.py: accept_torch), not
                     its one Triton program
    heads N rows     all kernels with N rows per program of the attention-heads kernel (heads.ROWS_PER_PROGRAM:
                     2)
    separate SiLU    all kernels but a tree's SiLU · up as the row kernel after the gate/up GEMM, not in that GEMM's
                     epilogue (ddtree/kernels/wgmma.py, Config.glu)
    torch gathers    all kernels but the embeddings, the rotary rows and the path's tap rows through torch's
                     index_select, and a draft vocabulary's token ids through an index kernel after the top-k
                     (not ddtree/kernels/gather.py's kernel, and the ids in the top-k's merge kernel)
    separate q and k/v
                     all kernels but a draft layer's q and k/v projections in two launches, not one
                     (ddtree/kernels/gemm.py, pair_linear)
    GEMM boxes B, S stages
                     all kernels but the Hopper GEMM's stages hold B 64-wide K boxes (wgmma.BOXES: 2), at most S deep
                     (wgmma.STAGE_LIMIT: 8; shared memory may allow fewer)
    few-row fp8 K 512, few-row fp8 K 512, 2 stages
                     all kernels but the few-row GEMM's fp8 products (an fp8 drafter's) in 512-wide K tiles, 3 or 2
                     stages deep (gemm.launch_config: 256-wide, 3-4 deep)
    late launches    all kernels but a tree's norms, heads and attention kernels let the next kernel launch only
                     once they have waited for the one before (not first: jit.early_pdl)
    late norms, late heads, late attention
                     the same for that step alone
    tree splits N    all kernels but trees of 129-384 grouped rows at head dim 128 (B = 32 and 64 on the 8B shape)
                     over N key-range splits (launch_config: 4 up to 192 rows, else 3)
    v4               cuBLAS and the separate compiled kernels (what the fast path ran before the kernels)

Two more time what a multi-row target layer would take without a step, as bounds on what folding it away could
gain. Their tokens are wrong (the layer skips the step's arithmetic), their times are real:

    bound: no tree norms       the target's multi-row layers skip both norms (and the residual adds in them)
    bound: no tree attention   the target's multi-row layers hand the queries on as the attention's output

    PYTHONPATH=server python benchmarks/ab_steps.py
    PYTHONPATH=server python benchmarks/ab_steps.py --draft-vocab 16384 --draft-quantization fp8 \
        --variants "all kernels" "separate quantization"
    PYTHONPATH=server python benchmarks/ab_steps.py --shape qwen3.6-27b --variants "all kernels" "cuBLAS one-row"
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import ddtree.fast
import torch
import triton
from ddtree.bench.command import build_shape, run
from ddtree.core.sampling import SamplingParams
from ddtree.fast.hybrid import HybridFastPath
from ddtree.fast.layers import Layer, Ops, TargetLayer
from ddtree.fast.runner import decoder_layer
from ddtree.kernels import attention, cache, gather, gdn, gemm, heads, jit, walk, wgmma
from ddtree.kernels import tree as tree_build
from ddtree.kernels.attention import TreeMask, tree_attention
from ddtree.kernels.tree import vocab_argmax

ALL = dict(row_gemv=True, skinny=True, heads="kernel", linear_gemv=True, gdn="all", lt=True,
           attention="now", pdl=True, rows="kernels", head_rows=heads.ROWS_PER_PROGRAM,
           quantizing_rows=True, commit="kernels", rope="table",
           walk="kernel", wgmma=True, glu=True, gather=True, paired=True, early=jit.EARLY_LAUNCH,
           boxes=(wgmma.BOXES, wgmma.STAGE_LIMIT), few_rows="now", bound=None)  # what the fast path runs
VARIANTS = {"all kernels": ALL, "no GEMV layers": {**ALL, "row_gemv": False},
            "cuBLAS one-row": {**ALL, "linear_gemv": False}, "cuBLAS few-row": {**ALL, "skinny": False},
            "cuBLAS many-row": {**ALL, "lt": False},
            "compiled heads": {**ALL, "skinny": False, "heads": "compiled"}, "PyTorch GDN tree": {**ALL, "gdn": "row"},
            "PyTorch GDN step": {**ALL, "gdn": "none"}, "v13 attention": {**ALL, "attention": "v13"},
            "direct trees": {**ALL, "attention": "direct trees"}, "v26 attention": {**ALL, "attention": "v26"},
            "no PDL": {**ALL, "pdl": False},
            "compiled rows": {**ALL, "rows": "compiled", "quantizing_rows": False, "glu": False},
            "separate quantization": {**ALL, "quantizing_rows": False},
            "PyTorch commit": {**ALL, "commit": "torch"}, "module RoPE": {**ALL, "rope": "module"},
            "PyTorch walk": {**ALL, "walk": "torch"}, "cuBLASLt trees": {**ALL, "wgmma": False},
            "separate SiLU": {**ALL, "glu": False}, "bound: no tree norms": {**ALL, "bound": "norms"},
            "bound: no tree attention": {**ALL, "bound": "attention"}, "torch gathers": {**ALL, "gather": False},
            "separate q and k/v": {**ALL, "paired": False}, "late launches": {**ALL, "early": frozenset()},
            **{f"late {label}": {**ALL, "early": ALL["early"] - {step}}
               for label, step in (("norms", "norm"), ("heads", "heads"), ("attention", "attention"))},
            **{f"heads {n} rows": {**ALL, "head_rows": n} for n in (2, 4, 8, 16)},
            **{f"tree splits {n}": {**ALL, "attention": f"splits {n}"} for n in (2, 3, 4, 5)},
            **{f"GEMM boxes {b}, {s} stages": {**ALL, "boxes": (b, s)} for b in (1, 2, 4) for s in (3, 4, 6, 8)},
            **{f"few-row {label}": {**ALL, "few_rows": label} for label in ("fp8 K 512", "fp8 K 512, 2 stages")},
            "v4": dict(row_gemv=False, skinny=False, heads="compiled", linear_gemv=False, gdn="none", lt=False,
                       attention="now", pdl=False, rows="compiled", head_rows=1, quantizing_rows=False,
                       commit="torch", rope="module", walk="torch", wgmma=False, glu=False, gather=False,
                       paired=False, early=frozenset(), boxes=(1, 8), few_rows="now", bound=None)}
ROW_STEPS = ("rms_norm", "add_rms_norm", "silu_mul")


def v13_attention(rows: int, capacity: int, kv_heads: int, sms: int, head_dim: int = 128) -> dict[str, int]:
    """attention.launch_config as v13 had it: one loop, and its tiles (the same at every head dim)."""
    if rows <= 16:
        block_m, block_n, splits, stages = 16, 64, triton.cdiv(2 * sms, kv_heads), 2
    elif rows <= 128:
        block_m, block_n, splits, stages = 16, 32, 6, 3
    elif rows <= 384:
        block_m, block_n, splits, stages = 32, 128, 3, 1
    else:
        block_m, block_n, splits, stages = 16, 128, 1, 2
    return dict(block_m=block_m, block_n=block_n, splits=max(1, min(splits, triton.cdiv(capacity, 64), 64)),
                num_warps=4, num_stages=stages, two_loops=0)


TUNED_ATTENTION = attention.launch_config  # ATTENTION's entries replace the module's for each variant


def direct_trees(rows: int, capacity: int, kv_heads: int, sms: int, head_dim: int = 128) -> dict[str, int]:
    """attention.launch_config, but trees of 17-1024 grouped rows in one split of 16-row tiles: no merge kernel."""
    cfg = TUNED_ATTENTION(rows, capacity, kv_heads, sms, head_dim)
    if 16 < rows <= 1024:
        cfg = {**cfg, "block_m": 16, "block_n": 64, "splits": 1, "num_stages": 3}
    return cfg


def without_norms(ops: Ops, layer: Layer, x: torch.Tensor, delta: torch.Tensor | None, cache: torch.Tensor,
                  mask: TreeMask, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decoder_layer without its norms (a bound, wrong tokens): the rows go to the projections as they come."""
    if not isinstance(layer, TargetLayer):
        return decoder_layer(ops, layer, x, delta, cache, mask, slots, cos, sin, eps)
    q = ops.attention_heads(*layer.project(x), layer.q_norm, layer.k_norm, eps, cos, sin, layer.kv_heads,
                            layer.head_dim, cache, slots)
    return x, x, layer.mlp(ops, layer.o(tree_attention(q, cache, mask)))


def without_attention(ops: Ops, layer: Layer, x: torch.Tensor, delta: torch.Tensor | None, cache: torch.Tensor,
                      mask: TreeMask, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decoder_layer without its attention kernels (a bound, wrong tokens): the grouped queries, viewed as the
    attention's [n, H * d] output, go to the output projection."""
    if not isinstance(layer, TargetLayer):
        return decoder_layer(ops, layer, x, delta, cache, mask, slots, cos, sin, eps)
    h, x = ops.normed(x, delta, layer.input_norm, eps, layer.fp8)
    entering = x
    q = ops.attention_heads(*layer.project(h), layer.q_norm, layer.k_norm, eps, cos, sin, layer.kv_heads,
                            layer.head_dim, cache, slots)
    h, x = ops.normed(x, layer.o(q.view(mask.n, -1)), layer.post_norm, eps, layer.fp8)
    return entering, x, layer.mlp(ops, h)


LAYERS = {None: decoder_layer, "norms": without_norms, "attention": without_attention}


VOCAB_TOP = tree_build.vocab_top


def ids_after_top(logits: torch.Tensor, k: int, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """tree.vocab_top as before v30: the kernels' columns, then token_ids[columns] (an index kernel of torch's)."""
    logp, columns = VOCAB_TOP(logits, k)
    return logp, columns if token_ids is None else token_ids[columns]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The picks as the fast path took them before tree.vocab_argmax."""
    return logits.argmax(dim=-1)


def v26_attention(rows: int, capacity: int, kv_heads: int, sms: int, head_dim: int = 128) -> dict[str, int]:
    """attention.launch_config as v26 had it: the new rows' keys in the split that also ends the committed keys."""
    cfg = TUNED_ATTENTION(rows, capacity, kv_heads, sms, head_dim)
    if cfg["two_loops"] == 2:
        block_n, splits, stages = (32, 4, 3) if rows <= 128 else (64, 3, 3 if rows <= 384 else 2)
        cfg = {**cfg, "block_n": block_n, "splits": min(splits, triton.cdiv(capacity, 64)), "num_stages": stages,
               "two_loops": 1}  # as launch_config, no more splits than the cache has 64-key blocks
    return cfg


def tree_splits(splits: int) -> Callable[..., dict[str, int]]:
    """attention.launch_config, but trees of 129-384 grouped rows at head dim 128 over `splits` splits."""
    def config(rows: int, capacity: int, kv_heads: int, sms: int, head_dim: int = 128) -> dict[str, int]:
        cfg = TUNED_ATTENTION(rows, capacity, kv_heads, sms, head_dim)
        return {**cfg, "splits": splits} if 128 < rows <= 384 and head_dim <= 128 else cfg
    return config


TUNED_FEW_ROWS = gemm.launch_config  # FEW_ROWS' entries replace the module's for each variant


def wide_fp8_tiles(stages: int) -> Callable[..., dict[str, int]]:
    """gemm.launch_config, but an fp8 weight's K tiles 512 wide (where its splits allow) over `stages` stages."""
    def config(n: int, k: int, fp8: bool = False) -> dict[str, int]:
        cfg = TUNED_FEW_ROWS(n, k, fp8)
        if fp8 and k % (cfg["split_k"] * 512) == 0 and k // cfg["split_k"] >= 1024:
            cfg = {**cfg, "block_k": 512, "num_stages": stages}
        return cfg
    return config


FEW_ROWS = {"now": TUNED_FEW_ROWS, "fp8 K 512": wide_fp8_tiles(3), "fp8 K 512, 2 stages": wide_fp8_tiles(2)}


ATTENTION = {"now": TUNED_ATTENTION, "v13": v13_attention, "direct trees": direct_trees, "v26": v26_attention,
             **{f"splits {n}": tree_splits(n) for n in (2, 3, 4, 5)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "qwen3.6-27b", "qwen3-30b-a3b"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2, help="times over the variants")
    ap.add_argument("--draft-vocab", default=None, metavar="N", help="draft only the N lowest ids")
    ap.add_argument("--draft-quantization", default="none", choices=["none", "fp8"])
    args = ap.parse_args()
    if args.passes < 1:
        ap.error("--passes must be at least 1")
    fast, _ = build_shape(args.shape, torch.device("cuda"), torch.bfloat16, fast_capacity=1024,
                          draft_vocab=args.draft_vocab, draft_quantization=args.draft_quantization)
    path = fast.fast
    gdn_rows, tree_max = getattr(path, "gdn_rows", set()), gdn.TREE_MAX
    compiled, kernels = Ops(compile=True), Ops(compile=True)
    kernels.take_row_kernels()
    head_steps = {"kernel": heads.attention_heads, "compiled": compiled.attention_heads}
    row_steps = {"kernels": kernels, "compiled": compiled}
    ropes = [rope for rope in (path.target_rope, getattr(path, "draft_rope", None)) if rope is not None]
    tables = [rope.table for rope in ropes]
    prompts = [torch.randint(0, 150000, (512,), generator=torch.Generator().manual_seed(0)).tolist()]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rounds = " | ".join(f"B = {b} round ms" for b in args.budgets)
    print(f"{args.shape}, draft vocabulary {args.draft_vocab or 'whole'}, draft quantization "
          f"{args.draft_quantization}\n")
    print(f"| variant | AR step ms | {rounds} | B = {args.budgets[0]} draft ms | trees' tokens against ar's |\n"
          f"|{'---|' * (4 + len(args.budgets))}")
    for _, label in itertools.product(range(args.passes), args.variants):
        variant = VARIANTS[label]
        if isinstance(path, HybridFastPath):  # its forward uses neither the GEMV layers nor the heads kernel
            path.gdn_rows = gdn_rows if variant["gdn"] != "none" else set()
            gdn.TREE_MAX = tree_max if variant["gdn"] == "all" else 1
        else:
            path.row_gemv, path.ops.attention_heads = variant["row_gemv"], head_steps[variant["heads"]]
        for step in ROW_STEPS:  # the hybrids' MLPs read silu_mul from path.ops at each call too
            setattr(path.ops, step, getattr(row_steps[variant["rows"]], step))
        path.ops.quantizing_rows = variant["quantizing_rows"]
        heads.ROWS_PER_PROGRAM = variant["head_rows"]
        gemm.ENABLED, gemm.ROW_GEMV, gemm.LT = variant["skinny"], variant["linear_gemv"], variant["lt"]
        wgmma.ENABLED = variant["wgmma"]
        if variant["boxes"] != (wgmma.BOXES, wgmma.STAGE_LIMIT):
            wgmma.BOXES, wgmma.STAGE_LIMIT = variant["boxes"]
            wgmma.launch_config.cache_clear()  # its configs carry the stage's boxes and depth
        gather.ENABLED = variant["gather"]
        gemm.PAIRED = variant["paired"]
        tree_build.vocab_top = VOCAB_TOP if variant["gather"] else ids_after_top
        path.ops.folding_silu = variant["glu"]
        ddtree.fast.decoder_layer = LAYERS[variant["bound"]]
        attention.launch_config = ATTENTION[variant["attention"]]
        gemm.launch_config = FEW_ROWS[variant["few_rows"]]
        jit.PDL = variant["pdl"]
        jit.EARLY_LAUNCH = variant["early"]
        kernel_commit = variant["commit"] == "kernels"
        ddtree.fast.compact = cache.compact if kernel_commit else cache.compact_torch
        ddtree.fast.vocab_argmax = vocab_argmax if kernel_commit else torch_argmax
        ddtree.fast.accept = walk.accept if variant["walk"] == "kernel" else walk.accept_torch
        for rope, table in zip(ropes, tables, strict=True):
            rope.table = table if variant["rope"] == "table" else None
        path._plans.clear()  # recapture with this variant's kernels
        ar = run(fast, prompts, "ar", 1, params)
        trees = [run(fast, prompts, "ddtree", budget, params) for budget in args.budgets]
        times = " | ".join(f"{tree['round_ms']:.3f}" for tree in trees)
        draft = trees[0]['phase_ms']['draft']
        print(f"| {label} | {ar['round_ms']:.3f} | {times} | {draft:.3f} | {partings(args.budgets, trees, ar)} |",
              flush=True)


def partings(budgets: list[int], trees: list[dict], ar: dict) -> str:
    """"same" when every budget's tokens are ar's, else where each budget first parts from them (prompt, token):
    random bf16 weights give near-flat logits, where a tree's GEMMs and an AR step's GEMV can round a near-tie
    apart, so a late parting is rounding and an early one on every prompt is worth a look."""
    found = []
    for budget, tree in zip(budgets, trees, strict=True):
        for prompt, (got, want) in enumerate(zip(tree["outputs"], ar["outputs"], strict=True)):
            if got != want:
                differ = (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
                token = next(differ, min(len(got), len(want)))  # or where the shorter one stopped
                found.append(f"B = {budget}: prompt {prompt}, token {token} of {len(want)}")
                break
    return "; ".join(found) or "same"


if __name__ == "__main__":
    main()
