"""Registers and stack per thread of the fast path's latency-bound Triton kernels, compiled for sm_90 (H100 /
H200) without a GPU; and the shared memory per block of its pipelined kernels, against a consumer GPU's.

A kernel whose build keeps values on the stack (spills, or arrays the compiler could not keep in registers)
reloads them from local memory inside its loops, which can make it many times slower; at batch 1 these
kernels are latency-bound, so that shows directly in a round. This compiles each one at the configurations the
fast path launches (and a few alternatives) with Triton's own ptxas and reads `cuobjdump -res-usage`. Run it
with the Triton the GPU machine has: register allocation changes between versions.

The kernels that pipeline `tl.dot` tiles (tree attention, the few-row GEMM, the MoE experts, the Gated
DeltaNet tree) are compiled again, for sm_86 (RTX 30-class; sm_89 allows the same 99 KB a block, and takes the
fp8 experts' column) and sm_90, at the configs the fast path launches on real shapes, in bf16 and float32 (and
the experts in fp8). Their tiles are tuned on an H200
(227 KB a block); a config over a GPU's limit fails to launch (OutOfResources), so each kernel that can
exceed 99 KB shrinks its tiles until it fits (`jit.launch_fitting`).

    PYTHONPATH=server python benchmarks/kernel_resources.py [--part registers|shared]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from collections.abc import Callable

import triton
from ddtree.kernels import attention, gdn
from ddtree.kernels import gemm as gemm_module
from ddtree.kernels import moe as moe_module
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HEADS, K_HEADS, D, TAPS = 48, 16, 128, 4  # Qwen3.6-27B's Gated DeltaNet layers
ATTENTION_ROWS = {4: "an AR step", 64: "a draft block, a dflash verify", 260: "a B = 64 tree", 516: "a B = 128 tree"}


SHARED_LIMITS = {86: 101376, 90: 232448}  # bytes a block may use: RTX 30/40-class (sm_86, sm_89), H100/H200
CONSUMER = 86


def compiled(fn: Callable, args: dict[str, str], consts: dict, warps: int, stages: int, arch: int = 90):
    """`fn` compiled for sm_`arch` with these argument types and constants (PDL off where the kernel takes it:
    the programmatic-launch wait changes no resource)."""
    consts = {"PDL": False, **consts} if "PDL" in fn.arg_names else consts
    # as a launch specializes them: tensors start 16-byte aligned and the shapes' strides are multiples of 16.
    # Without it Triton cannot prove cp.async's alignment and leaves the loops unpipelined (v31: the B = 64 tree
    # attention then read 32 KB of shared memory and spilled 376 bytes, where the launched kernel takes 116 KB)
    aligned = [(fn.arg_names.index(name),) for name, kind in args.items() if kind.startswith("*")
               or name.startswith("stride")]
    source = ASTSource(fn=fn, signature={**args, **{name: "constexpr" for name in consts}}, constexprs=consts,
                       attrs={index: [["tt.divisibility", 16]] for index in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                               "num_stages": stages})


def resources(fn: Callable, args: dict[str, str], consts: dict, warps: int, stages: int = 3) -> str:
    """`fn` compiled for sm_90 with these argument types and constants: "REG:n STACK:bytes"."""
    kernel = compiled(fn, args, consts, warps, stages)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return " ".join(field for field in line.split() if field.startswith(("REG:", "STACK:")))


def attention_build(block_m: int, block_n: int, splits: int, two_loops: int, dtype: str = "bf16",
                    head_dim: int = 128) -> tuple[Callable, dict[str, str], dict]:
    """The split kernel's argument types and constants at this config."""
    args = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Vis": "*i8", "Start": "*i64", "Acc": "*fp32",
            "Stats": "*fp32", "Out": f"*{dtype}", "Sinks": "*fp32",
            **{name: "i32" for name in ("stride_qh", "stride_qr", "stride_kh", "stride_kt", "stride_vh", "stride_vt",
                                        "rows", "n", "groups")},
            "scale": "fp32", "SPLITS": "i32"}
    consts = dict(WINDOW=0, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=dtype == "fp32",
                  DIRECT=splits == 1, TWO_LOOPS=two_loops, SINK=False)
    return attention._split_kernel, args, consts


def tree_attention(block_m: int, block_n: int, splits: int, warps: int, stages: int, two_loops: int) -> str:
    return resources(*attention_build(block_m, block_n, splits, two_loops), warps, stages)


def gdn_row(warps: int) -> str:
    args = {"Proj": "*bf16", "ConvState": "*bf16", "ConvW": "*bf16", "ALog": "*fp32", "DtBias": "*fp32",
            "State": "*fp32", "NormW": "*bf16", "Out": "*bf16", "Inputs": "*bf16", "Keys": "*fp32", "U": "*fp32",
            "Decay": "*fp32", "eps": "fp32", "scale": "fp32"}
    consts = dict(CONV_DIM=2 * K_HEADS * D + HEADS * D, KEY_DIM=K_HEADS * D, VALUE_DIM=HEADS * D, HEADS=HEADS,
                  GROUPS=HEADS // K_HEADS, DK=D, DV=D, TAPS=TAPS)
    return resources(gdn._row_kernel, args, consts, warps)


def gdn_tree_build(block: int, tile: int, dtype: str = "bf16") -> tuple[Callable, dict[str, str], dict]:
    args = {"State": "*fp32", "Vis": "*i8", "Keys": "*fp32", "U": "*fp32", "Decay": "*fp32", "Work": "*fp32",
            "Out": f"*{dtype}", "n": "i32"}
    consts = dict(HEADS=HEADS, DK=D, DV=D, SLICE=min(D, gdn.TREE_SLICE), BLOCK=block,
                  TILE=min(block, tile), CHUNK=min(D, gdn.TREE_CHUNK), PRECISION=gdn.TREE_PRECISION)
    return gdn._tree_delta_kernel, args, consts


def gdn_tree(block: int, warps: int, tile: int) -> str:
    return resources(*gdn_tree_build(block, tile), warps)


def gemm_build(rows: int, n: int, k: int, dtype: str) -> tuple[Callable, dict[str, str], dict, dict[str, int]]:
    """The few-row GEMM at `launch_config`'s tiles for an [n, k] weight and `rows` rows."""
    cfg = gemm_module.launch_config(n, k)
    args = {"X": f"*{dtype}", "XS": "*fp32", "W": f"*{dtype}", "WS": "*fp32", "W2": f"*{dtype}", "WS2": "*fp32",
            "Y": f"*{dtype}", "Part": "*fp32", "Count": "*i32", "M": "i32", "N1": "i32", "N": "i32", "stride_x": "i32",
            "stride_w": "i32", "stride_s": "i32"}
    consts = dict(K=k, PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_M=max(16, triton.next_power_of_2(rows)),
                  BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SPLIT_K=cfg["split_k"], FP8=False, SCALE_ROWS=0,
                  SCALE_COLS=1)
    return gemm_module._skinny_kernel, args, consts, cfg


def experts_build(part: str, pairs: int, hidden: int, inter: int, experts: int, top_k: int, dtype: str,
                  fp8: bool = False, block: tuple[int, int] | None = None
                  ) -> tuple[Callable, dict[str, str], dict, dict[str, int]]:
    """An MoE expert kernel (gate/up or down) at its tuned tiles, for `pairs` (row, expert) pairs; `fp8`: e4m3
    weights (and gate/up's rows) with channel scales, or `block` scales."""
    up = part == "up"
    cfg = moe_module.UP_CONFIG if up else moe_module.DOWN_CONFIG
    first, out = ("X", "Act") if up else ("A", "Out")
    operand = "fp8e4nv" if fp8 else dtype
    args = {first: f"*{operand if up else dtype}", "W": f"*{operand}", "Owners": "*i32", "Order": "*i64",
            out: f"*{dtype}", "WS": "*fp32", "N": "i32", "stride_we": "i32", "stride_se": "i32", "stride_s": "i32",
            **({"XS": "*fp32"} if up else {})}
    n, k = (2 * inter, hidden) if up else (hidden, inter)
    consts = dict(K=k, PAIRS=pairs, EXPERTS=experts, TOP_K=top_k, BY_EXPERT=pairs > experts,
                  BLOCK_P=triton.next_power_of_2(pairs), BLOCK_M=16, SORTED=pairs == top_k, BLOCK_N=cfg["block_n"],
                  PRECISION="ieee" if dtype == "fp32" else "tf32", **moe_module.k_loop(n, k, fp8, block))
    return (moe_module._up_kernel if up else moe_module._down_kernel), args, consts, cfg


def shared_table() -> None:
    """Shared memory per block of the pipelined kernels at their launched configs, sm_86 and sm_90."""
    builds: list[tuple[str, str, Callable, dict, dict, int, int, bool]] = []
    for dtype in ("bf16", "fp32"):
        for rows, kv, d, what in ((4, 8, 128, "8B AR step"), (64, 8, 128, "8B draft block"),
                                  (260, 8, 128, "8B B = 64 tree"), (516, 8, 128, "8B B = 128 tree"),
                                  (2048, 8, 128, "8B 512-token prompt chunk"), (390, 4, 256, "27B B = 64 tree"),
                                  (2048, 4, 256, "27B prompt chunk")):
            cfg = attention.launch_config(rows, 1024, kv, 132, d)
            fn, args, consts = attention_build(cfg["block_m"], cfg["block_n"], cfg["splits"], cfg["two_loops"],
                                               dtype, d)
            builds.append((f"tree attention, {what} ({rows} rows, d {d})", dtype, fn, args, consts,
                           cfg["num_warps"], cfg["num_stages"], True))
        for rows, n, k, what in ((16, 4096, 4096, "8B draft q/o"), (16, 24576, 4096, "8B draft gate/up"),
                                 (32, 4096, 12288, "8B draft down, 32 rows"), (16, 151936, 4096, "8B LM head")):
            fn, args, consts, cfg = gemm_build(rows, n, k, dtype)
            builds.append((f"few-row GEMM, {what}", dtype, fn, args, consts, cfg["num_warps"], cfg["num_stages"],
                           True))
        for part in ("up", "down"):
            for pairs, what in ((8, "AR step"), (520, "B = 64 tree")):
                fn, args, consts, cfg = experts_build(part, pairs, 2048, 768, 128, 8, dtype)
                builds.append((f"MoE {part}, 30B-A3B {what}", dtype, fn, args, consts, 4, cfg["num_stages"], True))
                for block, scales in ((None, "channel"), ((128, 128), "128 x 128 blocks")):
                    if dtype == "bf16":  # fp8 experts: bf16 rows and outputs
                        fn, args, consts, cfg = experts_build(part, pairs, 2048, 768, 128, 8, dtype, True, block)
                        builds.append((f"MoE {part} fp8 ({scales}), 30B-A3B {what}", "fp8", fn, args, consts, 4,
                                       cfg["num_stages"], True))
        for block, (warps, tile) in gdn.TREE_CONFIGS.items():
            if block <= gdn.TREE_MAX:
                fn, args, consts = gdn_tree_build(block, tile, dtype)
                builds.append((f"Gated DeltaNet tree, {block} nodes", dtype, fn, args, consts, warps, 3, False))
    limit = SHARED_LIMITS[CONSUMER] // 1024
    print(f"\nShared memory per block at the launched configs (KB; a consumer GPU allows {limit} KB, an H200 "
          f"{SHARED_LIMITS[90] // 1024})\n")
    print("| kernel | dtype | sm_86 | sm_90 | over a consumer GPU's | shrinks to fit |\n|---|---|---|---|---|---|")
    for name, dtype, fn, args, consts, warps, stages, fits in builds:
        kb = {arch: compiled(fn, args, consts, warps, stages, 89 if dtype == "fp8" and arch == 86 else arch
                             ).metadata.shared / 1024 for arch in SHARED_LIMITS}  # (fp8 from sm_89: the same 99 KB)
        over = "**yes**" if kb[CONSUMER] * 1024 > SHARED_LIMITS[CONSUMER] else "no"
        print(f"| {name} | {dtype} | {kb[86]:.1f} | {kb[90]:.1f} | {over} | {'yes' if fits else 'no'} |", flush=True)


def registers_table() -> None:
    """Registers and stack of the latency-bound kernels, sm_90."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["registers", "shared"], help="only one of the two tables")
    part = parser.parse_args().part
    print(f"Triton {triton.__version__}\n")
    if part != "shared":
        registers_table()
    if part != "registers":
        shared_table()


if __name__ == "__main__":
    main()
