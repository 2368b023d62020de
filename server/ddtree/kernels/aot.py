"""Ahead-of-time builds of the fast path's kernels for GPUs this machine does not have (Triton's target API).

The deployment this was first built for is an RTX PRO 6000 Blackwell (compute capability 12.0: no wgmma, about
100 KB of shared memory a block); the kernels are tuned on an H200 (9.0, 227 KB) and must also run on Ada (8.9:
L40S, RTX 6000 Ada, 99 KB). `build` compiles one kernel to a cubin for a capability on a CPU-only machine (the
ptxas that ships with the triton wheel), shrinking its tiles as `jit.launch_fitting` does at run time until its
shared memory fits; `CASES` are the fast path's kernels at the Qwen3-8B / Qwen3.6-27B shapes' launch configs, in
bf16 and fp8. `choices` is which kernel takes each product on a capability (what `gemm.linear` picks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    import triton
    from triton.backends.compiler import GPUTarget
except ImportError:  # CPU-only installs: the module imports; building needs Triton (`require_triton`)
    triton = None

# The opt-in shared memory of one block (cudaDevAttrMaxSharedMemoryPerBlockOptin), by compute capability.
SHARED_LIMIT = {89: 99 * 1024, 90: 227 * 1024, 120: 99 * 1024}


@dataclass(frozen=True)
class Case:
    """One kernel at one launch config: its pointers' element types (others: bf16), its scalars' types (those
    capitalised, and any not i32), constexprs, warps and stages; `shrink`: the tile launch_fitting halves after
    the stages (name, least)."""

    name: str
    fn: object
    constexprs: dict
    pointers: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1
    shrink: tuple[str, int] | None = None


def signature(case: Case) -> dict[str, str]:
    """Triton's signature of a case: its constexprs, its scalars (and lowercase parameters: i32), and pointers
    (the other capitalised parameters)."""
    sig = {}
    for p in case.fn.params:
        if p.name in case.constexprs:
            sig[p.name] = "constexpr"
        elif p.name in case.scalars or not p.name[0].isupper():
            sig[p.name] = case.scalars.get(p.name, "i32")
        else:
            sig[p.name] = "*" + case.pointers.get(p.name, "bf16")
    return sig


def require_triton() -> None:
    """Ahead-of-time builds compile Triton kernels: say so in one line where Triton is not installed."""
    if triton is None:
        raise RuntimeError("ahead-of-time kernel builds need Triton (pip install triton)")


def compile_case(case: Case, capability: int, constexprs: dict, num_stages: int) -> object:
    """The compiled kernel (cubin) of a case for `capability` (e.g. 90) at these constexprs and stages."""
    require_triton()
    src = triton.compiler.ASTSource(fn=case.fn, signature=signature(case), constexprs={
        (case.fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=case.num_warps, num_stages=num_stages))


def build(case: Case, capability: int) -> tuple[dict, int, int]:
    """(constexprs, stages, shared bytes) of the first config that fits the capability's shared memory: the tuned
    one, then fewer stages, then the shrink tile halved (launch_fitting's order). Raises if none fits."""
    constexprs, stages = dict(case.constexprs), case.num_stages
    while True:
        kernel = compile_case(case, capability, constexprs, stages)
        if kernel.metadata.shared <= SHARED_LIMIT[capability]:
            return constexprs, stages, kernel.metadata.shared
        if stages > 1:
            stages -= 1
        elif case.shrink and constexprs[case.shrink[0]] > case.shrink[1]:
            constexprs[case.shrink[0]] //= 2
        else:
            raise ValueError(f"{case.name} needs {kernel.metadata.shared} bytes of shared memory on sm_{capability}, "
                             f"more than its {SHARED_LIMIT[capability]}")


def choices(capability: int) -> dict[str, str]:
    """Which kernel takes each kind of product on a GPU of this capability (gemm.linear's choice): wgmma exists
    only in sm_90a; fp8 tensor cores from 8.9; PDL (griddepcontrol) from 9.0."""
    return {
        "one row, bf16": "Triton GEMV (norm / SiLU folded in)",
        "2-32 rows, bf16": "Triton few-row GEMM",
        "33-136 rows, bf16": "wgmma GEMM (NVRTC)" if capability == 90 else "cuBLASLt",
        "fp8 weights, any rows": "Triton few-row GEMM on e4m3 (fp8 tensor cores)" if capability >= 89 else "refused",
        "programmatic dependent launch": "yes" if capability >= 90 else "no",
    }


def cases(pdl: int) -> list[Case]:
    """The fast path's Triton kernels at launch configs of the Qwen3-8B and Qwen3.6-27B shapes (`pdl`: the PDL
    constexpr the capability gets)."""
    require_triton()
    from ddtree.kernels import attention, gemm, gemv, heads, paged_attention, rows, split_merge

    fp8 = {"X": "fp8e4nv", "W": "fp8e4nv", "W2": "fp8e4nv", "XS": "fp32", "WS": "fp32", "WS2": "fp32",
           "Part": "fp32", "Count": "i32"}
    skinny = {"Part": "fp32", "Count": "i32", "XS": "fp32", "WS": "fp32", "WS2": "fp32"}
    sizes = {"M": "i32", "N1": "i32", "N": "i32"}
    out = []
    for n, k in ((12288, 4096), (4096, 12288), (10240, 5120), (5120, 17408)):  # qkv / down of 8B, of 27B
        cfg = gemm.launch_config(n, k)
        common = dict(K=k, PRECISION="tf32", BLOCK_M=32, BLOCK_N=cfg["block_n"], SPLIT_K=cfg["split_k"], PDL=pdl)
        out.append(Case(f"skinny bf16 {n}x{k}", gemm._skinny_kernel,
                        dict(common, BLOCK_K=cfg["block_k"], FP8=False, SCALE_ROWS=0, SCALE_COLS=1), skinny, sizes,
                        num_stages=cfg["num_stages"], shrink=("BLOCK_K", 64)))
        cfg8 = gemm.launch_config(n, k, fp8=True)
        out.append(Case(f"skinny fp8 channel {n}x{k}", gemm._skinny_kernel,
                        dict(common, BLOCK_K=cfg8["block_k"], FP8=True, SCALE_ROWS=0, SCALE_COLS=1), fp8, sizes,
                        num_stages=cfg8["num_stages"], shrink=("BLOCK_K", 64)))
        cfgb = gemm.launch_config(n, k, fp8=True, scale_block=128)
        out.append(Case(f"skinny fp8 128x128 blocks {n}x{k}", gemm._skinny_kernel,
                        dict(common, BLOCK_M=64, BLOCK_K=cfgb["block_k"], FP8=True, SCALE_ROWS=128,
                             SCALE_COLS=128), fp8, sizes, num_stages=cfgb["num_stages"], shrink=("BLOCK_K", 64)))
    for mode, n, k in ((gemv.NORM, 6144, 4096), (gemv.SILU, 4096, 12288), (gemv.PLAIN, 4096, 4096)):
        cfg = gemv.launch_config(n, k)
        out.append(Case(f"gemv mode {mode} {n}x{k}", gemv._gemv_kernel, dict(
            K=k, MODE=mode, HAS_DELTA=mode == gemv.NORM, WRITE_ROW=False, BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"], UNROLL=cfg["unroll"], PDL=pdl), scalars={"N": "i32", "eps": "fp32"},
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    # fp8 rows: one scale per row (channel-scaled weights), or per 128 columns (a checkpoint's block-scaled ones)
    for k in (4096, 5120):
        for fp8, group, label in ((False, 0, ""), (True, 0, "fp8 "), (True, 128, "fp8 per 128 columns ")):
            out.append(Case(f"norm {label}{k}", rows._norm_kernel, dict(
                BLOCK_R=1, BLOCK=triton.next_power_of_2(k), HAS_DELTA=True, FP8=fp8, GROUP=group, PDL=pdl),
                {"Out": "fp8e4nv" if fp8 else "bf16", "S": "fp32"}, {"K": "i32", "eps": "fp32"},
                num_warps=min(16, max(1, triton.next_power_of_2(k) // 512))))
    for k in (12288, 17408):  # SiLU · up rows of the 8B and the 27B
        for group, label in ((0, ""), (128, "per 128 columns ")):
            out.append(Case(f"quantize SiLU {label}{k}", rows._quantize_kernel, dict(
                SILU=True, BLOCK_R=1, BLOCK=triton.next_power_of_2(k), GROUP=group, PDL=pdl),
                {"Q": "fp8e4nv", "S": "fp32"}, {"K": "i32"},
                num_warps=min(16, max(4, triton.next_power_of_2(k) // 1024))))
    out.append(Case("SiLU · up", rows._silu_kernel, dict(BLOCK=rows.SILU_BLOCK, PDL=pdl)))
    out.append(Case("q/k norm, RoPE, KV write", heads._heads_kernel, dict(
        HEADS=32, GROUPS=4, D=128, HAS_NORM=True, BLOCK_T=16, PDL=pdl), {"Slots": "i64"}, {"eps": "fp32"}))
    for block_m, block_n, stages, two_loops in ((16, 64, 2, 0), (64, 64, 3, 2)):
        out.append(Case(f"tree attention {block_m}x{block_n}", attention._split_kernel, dict(
            WINDOW=0, HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=False, DIRECT=False,
            TWO_LOOPS=two_loops, SINK=False, PDL=pdl), {"Vis": "i8", "Start": "i64", "Acc": "fp32",
                                                        "Stats": "fp32", "Sinks": "fp32"},
            {"scale": "fp32", "SPLITS": "i32"}, num_stages=stages, shrink=("BLOCK_N", 16)))
    out.append(Case("split attention merge", split_merge._merge_kernel, dict(
        HEAD_DIM=128, BLOCK_R=16, BLOCK_D=128, SPLITS=8, SINK=False, PDL=pdl),
        {"Acc": "fp32", "Stats": "fp32", "Sinks": "fp32"}))
    # sinks: a drafter's; split: decode rows, in one-row tiles (tile_rows) where a forward holds nothing else
    for sink, direct, block_m in ((False, True, 16), (True, True, 16), (False, False, 16), (False, False, 1)):
        out.append(Case("paged attention" + (" with sinks" if sink else "") + ("" if direct else ", split")
                        + (", one-row tiles" if block_m == 1 else ""), paged_attention._paged_kernel, dict(
            PAGE=16, WINDOW=0, GROUPS=4, HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=64,
            ROWS=max(paged_attention.MIN_DOT_ROWS, triton.next_power_of_2(block_m * 4)), IEEE=False, SINK=sink,
            DIRECT=direct),
            {"Starts": "i32", "Offsets": "i32", "Tables": "i32", "Vis": "i8", "VisOffsets": "i32", "Tiles": "i32",
             "Sinks": "fp32", "Acc": "fp32", "Stats": "fp32"}, {"scale": "fp32", "SPLITS": "i32"}, num_stages=2))
    out += gdn_cases()
    out += moe_cases()
    return out


def moe_cases() -> list[Case]:
    """The expert kernels at Qwen3-30B-A3B's shape (2048 -> 768, 128 experts, 8 a token) for an AR step's 8
    pairs: bf16, fp8 with channel scales and fp8 with 128 x 128 block scales; the router's kernel, which
    quantizes the rows for fp8 gate/up."""
    require_triton()
    from ddtree.kernels import moe

    hidden, inter, experts, top_k = 2048, 768, 128, 8
    out = [Case(f"experts route{label}", moe._route_kernel, dict(
        TOP_K=top_k, BLOCK_E=experts, RENORMALIZE=True, FP8=fp8, BLOCK_H=hidden if fp8 else 1, GROUP=group),
        {"Picks": "i32", "XQ": "fp8e4nv", "XS": "fp32"}, {"E": "i32", "H": "i32"})
        for fp8, group, label in ((False, 0, ""), (True, 0, " fp8"), (True, 128, " fp8 per 128 columns"))]
    formats = ((False, None, ""), (True, None, " fp8 channel"), (True, (128, 128), " fp8 128x128 blocks"))
    for fp8, block, label in formats:
        for name, fn, n, k, config in (("experts gate/up", moe._up_kernel, 2 * inter, hidden, moe.UP_CONFIG),
                                       ("experts down", moe._down_kernel, hidden, inter, moe.DOWN_CONFIG)):
            operand = "fp8e4nv" if fp8 else "bf16"
            out.append(Case(name + label, fn, dict(
                K=k, PAIRS=top_k, EXPERTS=experts, TOP_K=top_k, BY_EXPERT=False, BLOCK_P=top_k, BLOCK_M=16,
                SORTED=True, BLOCK_N=config["block_n"], PRECISION="tf32", **moe.k_loop(n, k, fp8, block)),
                {"Owners": "i32", "Order": "i32", "W": operand, "XS": "fp32", "WS": "fp32",
                 "X": operand if fn is moe._up_kernel else "bf16"}, {"N": "i32"}, num_stages=config["num_stages"],
                shrink=("BLOCK_N", 16)))
    return out


def gdn_cases() -> list[Case]:
    """The Gated DeltaNet kernels at the Qwen3.6-27B shape (48 value heads over 16 key heads, d_k = d_v = 128,
    conv width 4): the AR step's, a tree's (one sequence) and a batch's (varlen), at each padded tree width, with
    Triton's default pipeline depth (3), as they are launched."""
    require_triton()
    from ddtree.kernels import gdn

    heads, key_heads, d = 48, 16, 128
    shape = dict(CONV_DIM=2 * key_heads * d + heads * d, KEY_DIM=key_heads * d, VALUE_DIM=heads * d, HEADS=heads,
                 GROUPS=heads // key_heads, DK=d, DV=d, TAPS=4)
    pointers = {"State": "fp32", "StatePool": "fp32", "Keys": "fp32", "U": "fp32", "Decay": "fp32",
                "Work": "fp32", "Sources": "i64", "Vis": "i8", "SeqSlots": "i32", "RowOffsets": "i32",
                "VisOffsets": "i32"}
    scalars = {"eps": "fp32", "scale": "fp32"}
    slice_v = min(d, gdn.TREE_SLICE)
    stages = 3
    out = [Case("Gated DeltaNet AR step", gdn._row_kernel, shape, pointers, scalars, num_warps=gdn.ROW_WARPS,
                num_stages=stages),
           Case("Gated DeltaNet tree prep", gdn._tree_prep_kernel, shape, pointers, scalars, num_warps=1,
                num_stages=stages)]
    for block in (16, 32, 64):  # trees of up to gdn.TREE_MAX rows
        warps, tile = gdn.TREE_CONFIGS[block]
        delta = dict(HEADS=heads, DK=d, DV=d, SLICE=slice_v, BLOCK=block, TILE=min(block, tile),
                     CHUNK=min(d, gdn.TREE_CHUNK), PRECISION=gdn.TREE_PRECISION)
        work = dict(ROW_WORK=heads * (2 * d + 2 + d // slice_v * block), SEQ_WORK=heads * d // slice_v * block)
        out.append(Case(f"Gated DeltaNet tree delta {block}", gdn._tree_delta_kernel, delta, pointers,
                        num_warps=warps, num_stages=stages))
        out.append(Case(f"Gated DeltaNet varlen delta {block}", gdn._varlen_delta_kernel, dict(delta, **work),
                        pointers, num_warps=warps, num_stages=stages))
        if block == 64:
            out.append(Case("Gated DeltaNet varlen prep", gdn._varlen_prep_kernel, dict(shape, **work), pointers,
                            scalars, num_warps=1, num_stages=stages))
    out.append(Case("Gated DeltaNet commit", gdn._commit_kernel, dict(HEADS=heads, DK=d, DV=d, TILE=gdn.COMMIT_TILE),
                    dict(pointers, Slots="i32", Paths="i32", Lasts="i32"), num_warps=4, num_stages=stages))
    return out


def report(capabilities: list[int]) -> dict[int, list[dict]]:
    """Every case built for each capability: name, stages, shared bytes, and the constexprs that had to shrink (or
    the one-line reason it cannot be built)."""
    out = {}
    for capability in capabilities:
        rows = []
        for case in cases(pdl=int(capability >= 90)):
            try:
                constexprs, stages, shared = build(case, capability)
            except Exception as exc:  # a compile error is a finding to report, not to hide
                rows.append(dict(name=case.name, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}"))
                continue
            shrunk = {k: v for k, v in constexprs.items() if case.constexprs[k] != v}
            rows.append(dict(name=case.name, stages=stages, shared=shared, shrunk=shrunk))
        out[capability] = rows
    return out


if __name__ == "__main__":  # Triton's interpreter (TRITON_INTERPRET=1) must be off: run as its own process
    import json
    import sys

    print(json.dumps(report([int(c) for c in sys.argv[1:]] or sorted(SHARED_LIMIT))))
