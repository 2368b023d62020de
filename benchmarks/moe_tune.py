"""Mixture-of-experts blocks on a GPU: the Triton kernels (ddtree/kernels/moe.py) against the PyTorch steps, and
the kernels' launch configs.

Builds BLOCKS random Qwen3-30B-A3B-shaped sparse blocks (128 experts, 8 per token, 2048 -> 768 -> 2048) in
bf16, and times one pass through all of them, replayed as a CUDA graph (so the picked experts' weights come
from memory, not L2), at the row counts of an AR step and of B = 16 and B = 64 trees. Per row count it
prints the ms per block of each way, and the floor: the bytes of the experts the rows picked (plus the
router) at 4.8 TB/s.

    PYTHONPATH=server python benchmarks/moe_tune.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from ddtree.bench.timing import graph_ms
from ddtree.kernels import moe
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

BLOCKS = 8
SPEC_BANDWIDTH = 4.8e12


def blocks(count: int) -> list[moe.Experts]:
    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True)
    out = []
    for _ in range(count):
        block = Qwen3MoeSparseMoeBlock(cfg).to("cuda", torch.bfloat16)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        out.append(moe.Experts.of(block))
    return out


def floor_ms(experts: list[moe.Experts], h: torch.Tensor) -> float:
    """ms to read the router and the experts these rows pick, over every block, per block."""
    total = 0
    for e in experts:
        _, picks = moe.route(torch.nn.functional.linear(h, e.router), e.top_k, e.renormalize)
        distinct = picks.unique().numel()
        per_expert = (e.gate_up[0].numel() + e.down[0].numel()) * e.gate_up.element_size()
        total += distinct * per_expert + e.router.numel() * e.router.element_size()
    return total / len(experts) / SPEC_BANDWIDTH * 1e3


def time_blocks(experts: list[moe.Experts], h: torch.Tensor, kernels: bool) -> float:
    def run() -> None:
        for e in experts:
            e.routed_by_kernels(h) if kernels else e.routed_by_torch(h)
    return graph_ms(run) / len(experts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 17, 65])
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' launch configs")
    args = ap.parse_args()
    experts = blocks(BLOCKS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{BLOCKS} Qwen3-30B-A3B-shaped sparse blocks, bf16, {torch.cuda.get_device_name()}; ms per block")
    print("\n| rows | floor (picked experts at 4.8 TB/s) | PyTorch steps + grouped GEMM | Triton kernels |")
    print("|---|---|---|---|")
    for rows in args.rows:
        h = torch.randn(rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        ref = experts[0].routed_by_torch(h)
        got = experts[0].routed_by_kernels(h)
        assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2), (got - ref).abs().max()
        print(f"| {rows} | {floor_ms(experts, h):.4f} | {time_blocks(experts, h, False):.4f} | "
              f"{time_blocks(experts, h, True):.4f} |", flush=True)
    if not args.sweep:
        return
    print("\n| rows | up block_n / stages | down block_n / stages | ms per block |")
    print("|---|---|---|---|")
    up0, down0 = dict(moe.UP_CONFIG), dict(moe.DOWN_CONFIG)
    for rows in args.rows:
        h = torch.randn(rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        for (ub, us), (db, ds) in itertools.product(itertools.product([16, 32, 64], [3, 4]),
                                                    itertools.product([32, 64, 128], [3, 4])):
            moe.UP_CONFIG.update(block_n=ub, num_stages=us)
            moe.DOWN_CONFIG.update(block_n=db, num_stages=ds)
            print(f"| {rows} | {ub} / {us} | {db} / {ds} | {time_blocks(experts, h, True):.4f} |", flush=True)
        moe.UP_CONFIG.update(up0)
        moe.DOWN_CONFIG.update(down0)


if __name__ == "__main__":
    main()
