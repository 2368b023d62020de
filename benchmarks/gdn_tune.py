"""The Gated DeltaNet tree kernels (ddtree/fast/gdn.py): µs per layer call on a GPU, or registers and spills
without one, by the delta kernel's warps, d_v slice, row tile, d_k chunk and product precision.

A Qwen3.6-27B-shaped layer (48 value heads over 16 key heads, d 128, 4 conv taps, bf16) over random trees of
17, 33, 65 and 128 nodes; each config runs 48 calls (the shape's Gated DeltaNet layers) as one CUDA graph,
and its output is compared with the first config's (max |Δ|), so a config that computes something else shows.

--registers needs no GPU: it compiles the delta kernel, then the AR-step kernel, for sm_90 (Triton's own
ptxas) and prints the registers per thread and the bytes of stack (`cuobjdump -res-usage`). A kernel that
spills in its node loop runs many times slower, so this screens configs before a GPU run. Run it with the
Triton the GPU machine has: register allocation changes between versions.

    PYTHONPATH=server python benchmarks/gdn_tune.py [--nodes 17 65] [--warps 4 8] [--slices 32 64] [--tiles 16]
    PYTHONPATH=server python benchmarks/gdn_tune.py --registers
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import tempfile

import torch
from ddtree.fast import gdn
from ddtree.fast.bench import graph_ms
from ddtree.fast.delta import conv_sources
from ddtree.fast.fused import fuse
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


def registers(block: int, warps: int, slice_v: int, tile: int, chunk: int, precision: str) -> str:
    """The delta kernel compiled for sm_90 at this config: "REG:n STACK:bytes" from cuobjdump."""
    consts = dict(HEADS=HEADS, DK=D, DV=D, SLICE=slice_v, BLOCK=block, TILE=min(tile, block), CHUNK=chunk,
                  PRECISION=precision)
    args = {"State": "*fp32", "Vis": "*i8", "Keys": "*fp32", "U": "*fp32", "Decay": "*fp32", "Work": "*fp32",
            "Out": "*bf16", "n": "i32"}
    return _resources(gdn._tree_delta_kernel, args, consts, warps)


def row_registers(warps: int) -> str:
    """The AR-step kernel compiled for sm_90 at `warps`: "REG:n STACK:bytes"."""
    consts = dict(CONV_DIM=2 * K_HEADS * D + HEADS * D, KEY_DIM=K_HEADS * D, VALUE_DIM=HEADS * D, HEADS=HEADS,
                  GROUPS=HEADS // K_HEADS, DK=D, DV=D, TAPS=TAPS)
    args = {"Proj": "*bf16", "ConvState": "*bf16", "ConvW": "*bf16", "ALog": "*fp32", "DtBias": "*fp32",
            "State": "*fp32", "NormW": "*bf16", "Out": "*bf16", "Inputs": "*bf16", "Keys": "*fp32", "U": "*fp32",
            "Decay": "*fp32", "eps": "fp32", "scale": "fp32"}
    return _resources(gdn._row_kernel, args, consts, warps)


def _resources(fn, args: dict[str, str], consts: dict, warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**args, **{name: "constexpr" for name in consts}}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return " ".join(field for field in line.split() if field.startswith(("REG:", "STACK:")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[17, 33, 65, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--slices", type=int, nargs="+", default=[32, 64], help="d_v per program")
    ap.add_argument("--tiles", type=int, nargs="+", default=[16, 32], help="rows per product")
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32], help="d_k per product")
    ap.add_argument("--precisions", nargs="+", default=["tf32x3"], choices=["ieee", "tf32x3", "tf32"])
    ap.add_argument("--registers", action="store_true", help="compile for sm_90 and report registers (no GPU)")
    args = ap.parse_args()
    configs = list(itertools.product(args.warps, args.slices, args.tiles, args.chunks, args.precisions))
    if args.registers:
        print("| nodes (padded) | warps | d_v slice | tile | chunk | precision | resources |\n"
              "|---|---|---|---|---|---|---|")
        for nodes, config in itertools.product(args.nodes, configs):
            block = max(16, 1 << (nodes - 1).bit_length())
            print(f"| {nodes} ({block}) | {' | '.join(map(str, config))} | {registers(block, *config)} |", flush=True)
        print("\n| AR-step kernel warps | resources |\n|---|---|")
        for warps in args.warps:
            print(f"| {warps} | {row_registers(warps)} |", flush=True)
        return
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
            gdn.TREE_WARPS, gdn.TREE_SLICE, gdn.TREE_TILE, gdn.TREE_CHUNK = warps, slice_v, tile, chunk
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
