"""Hybrid (Gated DeltaNet) tree verification on a GPU: kernel agreement and per-round verify cost.

1. Kernel check: the same tree verify through flash-linear-attention's kernels and through the pure-torch
   reference, on a small random hybrid model in bf16: logits and committed states must agree within bf16
   tolerance.
2. Cost: a Qwen3.6-27B-shaped target (random bf16 weights, real layer shapes) after a prompt: one AR step
   and one tree verify at each budget, timed with CUDA events after warm-up (median of repeats), plus one
   pass of a Qwen3.6-27B-DFlash-shaped draft.

    PYTHONPATH=server python benchmarks/hybrid_verify.py --shape qwen3.6-27b --budgets 16 32 64 --json out.json
    PYTHONPATH=server python benchmarks/hybrid_verify.py --shape small --device cpu   # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from ddtree.core.tree import build_tree
from ddtree.models.draft import DraftCache
from ddtree.models.hybrid import GDNKernels
from ddtree.models.shapes import SHAPES as BENCH_SHAPES
from ddtree.models.shapes import build_draft, build_target, hybrid_shape

# The Qwen3.6-27B shape, hybrid_shape and the builders are models/shapes.py's: one definition of each.
SHAPES = {
    "qwen3.6-27b": BENCH_SHAPES["qwen3.6-27b"],
    # Real Gated DeltaNet head shapes in a short, narrow stack: for comparing kernels cheaply.
    "gdn-heads": hybrid_shape(
        target=dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=16,
                    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
        draft=dict(num_layers=1, intermediate_size=2048, target_layer_ids=[1])),
    "small": hybrid_shape(
        target=dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32),
        draft=dict(num_layers=2, intermediate_size=512, target_layer_ids=[1, 6])),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def crop(cache, past: int) -> None:
    """Drop what a timed verify appended, so every repeat sees the same committed prefix."""
    for layer in cache.kv.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[:, :, :past], layer.values[:, :, :past]
    cache.node_conv.clear()
    cache.node_recurrent.clear()


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def random_tree(vocab: int, budget: int, seed: int):
    """A tree from peaked random draft logits: a confident first and second choice at every depth, so the
    tree is deep and narrow like a real drafter's."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(15, vocab, generator=gen)
    top = torch.randint(0, vocab, (15, 2), generator=gen)
    logits.scatter_add_(1, top, torch.tensor([[12.0, 10.5]]).expand(15, 2))
    return build_tree(logits, budget)


def kernel_check(device: torch.device, dtype: torch.dtype, budget: int) -> dict:
    """fla vs torch kernels on the same model, prompt and tree."""
    target = build_target(SHAPES["gdn-heads"], device, dtype)
    modeling = sys.modules[type(target.gdn.layers[0]).__module__]
    fla = GDNKernels.select(modeling, device)
    if fla.name != "fla":
        return {"skipped": "flash-linear-attention is not importable on this device"}
    torch_kernels = GDNKernels.select(modeling, torch.device("cpu"))
    if torch_kernels.chunk is fla.chunk or torch_kernels.recurrent is fla.recurrent:
        raise RuntimeError("the torch reference resolved to the fla kernels; the comparison would be empty")
    prompt = torch.randint(0, 4000, (200,), device=device)
    tree = random_tree(4096, budget, seed=0)
    ids = torch.tensor([7, *tree.tokens], device=device)
    pos = torch.tensor([0, *tree.depths], device=device) + len(prompt)
    results = {}
    for kernels in (fla, torch_kernels):
        target.gdn.kernels = kernels
        cache = target.new_cache()
        target.forward(prompt, torch.arange(len(prompt), device=device), cache)
        logits, _ = target.forward(ids, pos, cache, tree=tree)
        target.compact(cache, len(prompt), [0])
        results[kernels.name] = (logits.float(), {k: v.float() for k, v in cache.recurrent.items()})
    (lf, sf), (lt, st) = results["fla"], results["torch"]
    scale = lt.abs().max().item()
    state_err = max(((sf[k] - st[k]).abs().max() / st[k].abs().max().clamp_min(1e-6)).item() for k in st)
    return {
        "nodes": tree.size + 1,
        "logits_max_abs_diff": (lf - lt).abs().max().item(),
        "logits_scale": scale,
        "logits_rel_diff": (lf - lt).abs().max().item() / scale,
        "top1_agreement": (lf.argmax(-1) == lt.argmax(-1)).float().mean().item(),
        "state_max_rel_diff": state_err,
    }


@torch.inference_mode()
def cost(shape_name: str, device: torch.device, dtype: torch.dtype, budgets: list[int], context: int,
         repeats: int) -> dict:
    shape = SHAPES[shape_name]
    t = time.perf_counter()
    target = build_target(shape, device, dtype)
    draft = build_draft(shape, target, device, dtype)
    target.set_taps(draft.config.target_layer_ids)
    params = sum(p.numel() for p in target.model.parameters())
    log(f"built {shape_name}: {params / 1e9:.2f} B parameters in {time.perf_counter() - t:.0f} s "
        f"(GDN kernels: {target.gdn.kernels.name})")
    vocab = shape["target"]["vocab_size"]
    prompt = torch.randint(0, vocab - 2, (context,), device=device)
    cache = target.new_cache()
    _, taps = target.forward(prompt, torch.arange(context, device=device), cache, logits_rows=1)
    draft_cache = DraftCache(len(draft.layers))
    draft.extend_context(draft_cache, taps[None], torch.arange(context, device=device)[None])
    out = {"shape": shape_name, "parameters": params, "context": context, "dtype": str(dtype).removeprefix("torch."),
           "gdn_kernels": target.gdn.kernels.name, "device": torch.cuda.get_device_name() if device.type == "cuda"
           else "cpu", "budgets": {}}

    root = torch.tensor([11], device=device)

    def ar_step():
        target.forward(root, torch.tensor([context], device=device), cache)
        crop(cache, context)

    committed = (dict(cache.conv), dict(cache.recurrent))

    def restore():
        cache.conv.update(committed[0])
        cache.recurrent.update(committed[1])

    def ar_step_restoring():
        ar_step()
        restore()

    out["ar_step_ms"] = timed(ar_step_restoring, device, repeats)
    block_size = draft.config.block_size
    block = torch.full((block_size,), draft.config.mask_token_id, device=device)
    block_pos = torch.arange(context, context + block_size, device=device)[None]

    def draft_pass():
        hidden = draft(target.embed_tokens(block)[None], block_pos, cache=draft_cache)
        return target.lm_head(hidden[0, 1:])

    out["draft_pass_ms"] = timed(draft_pass, device, repeats)
    for budget in budgets:
        tree = random_tree(vocab, budget, seed=budget)
        ids = torch.tensor([11, *tree.tokens], device=device)
        pos = torch.tensor([0, *tree.depths], device=device) + context

        def verify(tree=tree, ids=ids, pos=pos):
            target.forward(ids, pos, cache, tree=tree)
            crop(cache, context)

        logits = draft_pass()
        build_ms = timed(lambda logits=logits, budget=budget: build_tree(logits, budget), device, repeats)
        verify_ms = timed(verify, device, repeats)
        out["budgets"][budget] = {"nodes": tree.size + 1, "max_depth": max(tree.depths), "verify_ms": verify_ms,
                                  "verify_vs_ar_step": verify_ms / out["ar_step_ms"], "tree_build_ms": build_ms}
        log(f"budget {budget}: verify {verify_ms:.1f} ms ({verify_ms / out['ar_step_ms']:.2f}x an AR step), "
            f"tree build {build_ms:.2f} ms")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernels-only", action="store_true", help="only compare the fla and torch kernels")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    results = {"kernel_check": kernel_check(device, dtype, budget=32)}
    log(f"kernel check: {results['kernel_check']}")
    if not args.kernels_only:
        results["cost"] = cost(args.shape, device, dtype, args.budgets, args.context, args.repeats)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
