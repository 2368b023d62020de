"""The Gated DeltaNet tree kernels (ddtree/kernels/gdn.py) on a GPU: µs per layer call by the delta kernel's warps,
d_v slice, row tile, d_k chunk and product precision.

A Qwen3.6-27B-shaped layer (48 value heads over 16 key heads, d 128, 4 conv taps, bf16) over random trees of
17, 33, 65 and 128 nodes; each config runs 48 calls (the shape's Gated DeltaNet layers) as one CUDA graph,
and its output is compared with the first config's (max |Δ|), so a config that computes something else shows.

benchmarks/kernel_resources.py screens configs without a GPU (registers and stack per thread).

    PYTHONPATH=server python benchmarks/gdn_tune.py [--nodes 17 65] [--warps 4 8] [--slices 32 64] [--tiles 16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from ddtree.bench.timing import graph_ms
from ddtree.fast.delta import conv_sources
from ddtree.fast.layers import fuse
from ddtree.kernels import gdn
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

HEADS, K_HEADS, D, TAPS, LAYERS = 48, 16, 128, 4, 48


def random_tree(nodes: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible [n, n], conv sources [n, TAPS]) of a random tree whose nodes follow their parents."""
    visible = torch.eye(nodes, dtype=torch.bool)
    depths = torch.zeros(nodes, dtype=torch.long)
    for i in range(1, nodes):
        parent = int(torch.randint(max(0, i - 4), i, ()))  # near parents: deep, narrow trees like DDTree's
        visible[i] |= visible[parent]
        depths[i] = depths[parent] + 1
    return visible.to(device), conv_sources(visible, depths, TAPS).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[17, 33, 65, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--slices", type=int, nargs="+", default=[32, 64], help="d_v per program")
    ap.add_argument("--tiles", type=int, nargs="+", default=[16, 32], help="rows per product")
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32], help="d_k per product")
    ap.add_argument("--precisions", nargs="+", default=["tf32x3"], choices=["ieee", "tf32x3", "tf32"])
    args = ap.parse_args()
    configs = list(itertools.product(args.warps, args.slices, args.tiles, args.chunks, args.precisions))
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=K_HEADS, linear_num_value_heads=HEADS,
                               linear_key_head_dim=D, linear_value_head_dim=D, linear_conv_kernel_dim=TAPS)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0).cuda().to(torch.bfloat16)
    module.A_log.data, module.dt_bias.data = module.A_log.data.float(), module.dt_bias.data.float()
    fuse(module, "ddtree_in_proj", [module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a])
    conv_dim = module.conv_dim
    conv_state = torch.randn(TAPS - 1, conv_dim, device="cuda").to(torch.bfloat16)
    state = torch.randn(HEADS, D, D, device="cuda") / D
    print("| nodes | warps | d_v slice | tile | chunk | precision | µs per layer | max abs diff to the first config |\n"
          "|---|---|---|---|---|---|---|---|")
    for nodes in args.nodes:
        visible, sources = random_tree(nodes, "cuda")
        proj = torch.randn(nodes, conv_dim + module.value_dim + 2 * HEADS, device="cuda").to(torch.bfloat16)
        record = (torch.empty(TAPS - 1 + nodes, conv_dim, device="cuda", dtype=torch.bfloat16),
                  sources, visible, torch.empty(nodes, HEADS, D, device="cuda"),
                  torch.empty(nodes, HEADS, D, device="cuda"), torch.empty(nodes, HEADS, device="cuda"))
        first = None
        for warps, slice_v, tile, chunk, precision in configs:
            gdn.TREE_CONFIGS = dict.fromkeys(gdn.TREE_CONFIGS, (warps, tile))
            gdn.TREE_SLICE, gdn.TREE_CHUNK = slice_v, chunk
            gdn.TREE_PRECISION = precision
            label = f"| {nodes} | {warps} | {slice_v} | {tile} | {chunk} | {precision} |"
            try:
                out = gdn.tree_step(module, proj, conv_state, state, *record)
            except Exception as exc:  # a config the compiler cannot fit (registers, shared memory)
                print(f"{label} failed: {type(exc).__name__} | |", flush=True)
                continue
            first = out if first is None else first
            call = (module, proj, conv_state, state, *record)
            ms = graph_ms(lambda call=call: [gdn.tree_step(*call) for _ in range(LAYERS)])
            diff = (out.float() - first.float()).abs().max().item()
            print(f"{label} {1e3 * ms / LAYERS:.1f} | {diff:.4f} |", flush=True)


if __name__ == "__main__":
    main()
