"""Registers and stack per thread of the fast path's latency-bound Triton kernels, compiled for sm_90 (H100 /
H200) without a GPU.

A kernel whose build keeps values on the stack (spills, or arrays the compiler could not keep in registers)
reloads them from local memory inside its loops, which can make it many times slower; at batch 1 these
kernels are latency-bound, so that shows directly in a round. This compiles each one at the configurations the
fast path launches (and a few alternatives) with Triton's own ptxas and reads `cuobjdump -res-usage`. Run it
with the Triton the GPU machine has: register allocation changes between versions.

    PYTHONPATH=server python benchmarks/kernel_resources.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable

import triton
from ddtree.fast import attention, gdn
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HEADS, K_HEADS, D, TAPS = 48, 16, 128, 4  # Qwen3.6-27B's Gated DeltaNet layers
ATTENTION_ROWS = {4: "an AR step", 64: "a draft block, a dflash verify", 260: "a B = 64 tree", 516: "a B = 128 tree"}


def resources(fn: Callable, args: dict[str, str], consts: dict, warps: int, stages: int = 3) -> str:
    """`fn` compiled for sm_90 with these argument types and constants: "REG:n STACK:bytes"."""
    source = ASTSource(fn=fn, signature={**args, **{name: "constexpr" for name in consts}}, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps,
                                                                               "num_stages": stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return " ".join(field for field in line.split() if field.startswith(("REG:", "STACK:")))


def tree_attention(block_m: int, block_n: int, splits: int, warps: int, stages: int, two_loops: int) -> str:
    args = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Vis": "*i8", "Start": "*i64", "Acc": "*fp32",
            "Stats": "*fp32", "Out": "*bf16", **{name: "i32" for name in ("stride_qh", "stride_qr", "stride_kh",
                                                                          "stride_kt", "stride_vh", "stride_vt",
                                                                          "rows", "n", "groups")},
            "scale": "fp32", "SPLITS": "i32"}
    consts = dict(WINDOW=0, HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=False, DIRECT=splits == 1,
                  TWO_LOOPS=two_loops)
    return resources(attention._split_kernel, args, consts, warps, stages)


def gdn_row(warps: int) -> str:
    args = {"Proj": "*bf16", "ConvState": "*bf16", "ConvW": "*bf16", "ALog": "*fp32", "DtBias": "*fp32",
            "State": "*fp32", "NormW": "*bf16", "Out": "*bf16", "Inputs": "*bf16", "Keys": "*fp32", "U": "*fp32",
            "Decay": "*fp32", "eps": "fp32", "scale": "fp32"}
    consts = dict(CONV_DIM=2 * K_HEADS * D + HEADS * D, KEY_DIM=K_HEADS * D, VALUE_DIM=HEADS * D, HEADS=HEADS,
                  GROUPS=HEADS // K_HEADS, DK=D, DV=D, TAPS=TAPS)
    return resources(gdn._row_kernel, args, consts, warps)


def gdn_tree(block: int, warps: int, tile: int) -> str:
    args = {"State": "*fp32", "Vis": "*i8", "Keys": "*fp32", "U": "*fp32", "Decay": "*fp32", "Work": "*fp32",
            "Out": "*bf16", "n": "i32"}
    consts = dict(HEADS=HEADS, DK=D, DV=D, SLICE=min(D, gdn.TREE_SLICE), BLOCK=block,
                  TILE=min(block, tile), CHUNK=min(D, gdn.TREE_CHUNK), PRECISION=gdn.TREE_PRECISION)
    return resources(gdn._tree_delta_kernel, args, consts, warps)


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90\n")
    print("Tree attention (`_split_kernel`, 8 K/V heads, d 128, bf16)\n")
    print("| grouped rows | block_m x block_n | splits | warps | stages | launched | resources |\n"
          "|---|---|---|---|---|---|---|")
    for rows, what in ATTENTION_ROWS.items():
        cfg = attention.launch_config(rows, 1024, 8, 132)
        tried = [(cfg["block_m"], cfg["block_n"], cfg["splits"], cfg["num_warps"], cfg["num_stages"])]
        tried += [(block_m, 64, cfg["splits"], 8, 2) for block_m in (16, 32)] if rows > 64 else []
        for i, (block_m, block_n, splits, warps, stages) in enumerate(tried):
            launched = f"yes ({what})" if i == 0 else "no"
            print(f"| {rows} | {block_m} x {block_n} | {splits} | {warps} | {stages} | {launched} | "
                  f"{tree_attention(block_m, block_n, splits, warps, stages, cfg['two_loops'])} |", flush=True)
    print("\nGated DeltaNet, Qwen3.6-27B widths (48 value heads over 16 key heads, d 128)\n")
    print("| kernel | padded nodes | warps | row tile | launched | resources |\n|---|---|---|---|---|---|")
    for warps in (4, 8, 16):
        launched = "yes" if warps == gdn.ROW_WARPS else "no"
        print(f"| AR step (`_row_kernel`) | 1 | {warps} | - | {launched} | {gdn_row(warps)} |", flush=True)
    for block, (warps, tile) in gdn.TREE_CONFIGS.items():
        launched = "yes" if block <= gdn.TREE_MAX else "no (trees over TREE_MAX take the PyTorch steps)"
        print(f"| tree delta (`_tree_delta_kernel`) | {block} | {warps} | {tile} | {launched} | "
              f"{gdn_tree(block, warps, tile)} |", flush=True)


if __name__ == "__main__":
    main()
