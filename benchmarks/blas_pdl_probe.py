"""Probe: cuBLAS's kernels as programmatic dependents (PDL) inside our CUDA graphs. Is it safe, and what would it take?

cuBLAS launches its GEMMs normally, so in a captured round each of a tree verify's 145 cuBLASLt GEMMs starts only
once the kernel before it has finished, while our Triton kernels overlap their neighbours (ddtree/kernels/jit.py).
A kernel may launch early only if it executes griddepcontrol.wait (SASS ACQBULK) before reading its inputs. This
rewrites a captured graph's kernel -> cuBLAS-kernel edges as programmatic edges (driver API, through ctypes), then:

1. race: per projection shape of the 8B verify, a kernel that lets its dependents launch at once, spins, then
   writes the GEMM's input. Behind it on a programmatic edge, a GEMM that waits reads the written input (error
   0); one that does not reads zeros.
2. rounds: the 8B shape's AR step and B = 16 / 32 / 64 rounds (fp8 draft, 16384 draft tokens) with and without
   the rewrite, alternated, and whether their tokens are the same.

Rerun it when cuBLAS changes: if every GEMM of a round waits, the rewrite is safe.

    PYTHONPATH=server python benchmarks/blas_pdl_probe.py [--skip-rounds]
"""

from __future__ import annotations

import argparse
import ctypes
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from ddtree.fast.runner import FastPath
from ddtree.kernels.gemm import linear
from triton.language.extra.cuda import gdc_launch_dependents

cu = ctypes.CDLL("libcuda.so.1")
KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
CONVERTED: list[int] = []  # edges rewritten per captured graph of the current variant


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def check(status: int, what: str) -> None:
    """A driver call's status as an exception, with the driver's name for it."""
    if status != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what}: {name.value}")


def kernel_name(node: int) -> str | None:
    """A graph node's kernel name (None: not a kernel node)."""
    kind = ctypes.c_int()
    check(cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "type")
    if kind.value != KERNEL:
        return None
    p = KernelParams()
    check(cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)), "params")
    name = ctypes.c_char_p()
    if p.func:
        check(cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(p.func)), "func name")
    else:
        check(cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(p.kern)), "kernel name")
    return name.value.decode()


def edges(graph: int) -> tuple[list[int], list[int], list[EdgeData]]:
    """Every edge of a graph: sources, destinations and their data (ports, type)."""
    n = ctypes.c_size_t()
    check(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "edges")
    src, dst = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (EdgeData * n.value)()
    check(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n)), "edges")
    return [s or 0 for s in src], [d or 0 for d in dst], list(data)


def is_blas(name: str) -> bool:
    """cuBLAS's kernels (nvjet, xmma, CUTLASS), not our Triton GEMM."""
    return "nvjet" in name or "xmma" in name or "cutlass" in name.lower() or ("gemm" in name and "skinny" not in name)


def make_programmatic(graph: int, report: dict | None = None) -> int:
    """Every default edge kernel -> cuBLAS kernel becomes programmatic (the destination may launch once the
    source triggers; it must wait itself). Returns how many."""
    src, dst, data = edges(graph)
    names: dict[int, str | None] = {}
    done = 0
    for s, d, e in zip(src, dst, data, strict=True):
        for node in (s, d):
            if node not in names:
                names[node] = kernel_name(node)
        if e.type != 0 or names[s] is None or names[d] is None or not is_blas(names[d]):
            continue
        one_s, one_d = (ctypes.c_void_p * 1)(s), (ctypes.c_void_p * 1)(d)
        check(cu.cuGraphRemoveDependencies_v2(ctypes.c_void_p(graph), one_s, one_d, None, 1), "remove")
        prog = (EdgeData * 1)()
        prog[0].from_port, prog[0].type = 1, 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, ..._TYPE_PROGRAMMATIC
        check(cu.cuGraphAddDependencies_v2(ctypes.c_void_p(graph), one_s, one_d, prog, 1), "add")
        done += 1
        if report is not None:
            report[names[d]] = report.get(names[d], 0) + 1
    return done


@triton.jit
def _late_writer(X, Src, n, spin, BLOCK: tl.constexpr):
    """Let dependents launch at once, spin, then copy Src into X."""
    gdc_launch_dependents()
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(spin):
        acc = acc * 0.999 + 1.0
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(Src + offs, mask=offs < n)
    tl.store(X + offs, tl.where(acc > -1.0, v, 0.0), mask=offs < n)


def graph_kernels(graph: torch.cuda.CUDAGraph) -> list[str]:
    """The kernel names of a kept graph's nodes."""
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t()
    check(cu.cuGraphGetNodes(raw, None, ctypes.byref(n)), "nodes")
    nodes = (ctypes.c_void_p * n.value)()
    check(cu.cuGraphGetNodes(raw, nodes, ctypes.byref(n)), "nodes")
    return [name for node in nodes if (name := kernel_name(node or 0)) is not None]


def race_behind_writer(gemm: Callable[[torch.Tensor], torch.Tensor], src: torch.Tensor, want: torch.Tensor,
                       spin: int, replays: int = 5, report: dict | None = None) -> tuple[float, int, list[str]]:
    """gemm(x) captured behind a late writer of x (src's values), its kernel -> cuBLAS-kernel edges made
    programmatic: the max |error| against `want` over the replays, the edges rewritten, the GEMM's kernels."""
    x = torch.zeros_like(src)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemm(x)  # warm up cuBLAS' handle and workspace outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            x.zero_()
            _late_writer[(triton.cdiv(src.numel(), 1024),)](x, src, src.numel(), spin, BLOCK=1024)
            y = gemm(x)
    names = [name for name in graph_kernels(graph) if "late_writer" not in name]
    converted = make_programmatic(graph.raw_cuda_graph(), report)
    graph.instantiate()
    worst = 0.0
    for _ in range(replays):
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, (y.float() - want.float()).abs().max().nan_to_num(float("inf")).item())
    return worst, converted, names


def race(rows: int, n: int, k: int, spin: int) -> tuple[float, str]:
    """Max |error| of `linear` behind a late writer on a programmatic edge, and the rewired GEMM kernels' names."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    src = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    report: dict[str, int] = {}
    worst, _, _ = race_behind_writer(lambda x: linear(x, w), src, linear(src, w), spin, report=report)
    return worst, ", ".join(f"{name[:60]} x{count}" for name, count in report.items()) or "no cuBLAS edge"


def patched_capture(convert: bool) -> Callable:
    """FastPath._capture, keeping the graph to rewrite its edges before instantiating it."""

    def capture(self: FastPath, fn: Callable, arg: object) -> tuple[torch.cuda.CUDAGraph, object]:
        self._warm_up(fn, arg)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            out = fn(arg)
        if convert:
            CONVERTED.append(make_programmatic(graph.raw_cuda_graph()))
        graph.instantiate()
        graph.replay()
        self.start.zero_()
        return graph, out

    return capture


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin", type=int, default=200000)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--skip-rounds", action="store_true")
    args = ap.parse_args()
    print("## race: a GEMM behind a late writer on a programmatic edge\n")
    print("| rows | N x K | max abs error | cuBLAS kernels on programmatic edges |\n|---|---|---|---|")
    for rows in (65, 33):
        for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)):
            worst, names = race(rows, n, k, args.spin)
            print(f"| {rows} | {n} x {k} | {worst:.3g} | {names} |", flush=True)
    if args.skip_rounds:
        return
    from ddtree.bench.command import build_shape, run
    from ddtree.core.sampling import SamplingParams

    fast, _ = build_shape("qwen3-8b", torch.device("cuda"), torch.bfloat16, fast_capacity=1024,
                          draft_vocab="16384", draft_quantization="fp8")
    prompts = [torch.randint(0, 150000, (512,), generator=torch.Generator().manual_seed(0)).tolist()]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    print("\n## rounds (8B shape, fp8 draft, 16384 draft tokens): ms\n")
    print("| cuBLAS launches | AR step | " + " | ".join(f"B = {b}" for b in args.budgets)
          + " | edges rewritten | tokens equal |\n|" + "---|" * (4 + len(args.budgets)))
    outputs = {}
    for _ in range(args.passes):
        for convert in (False, True):
            FastPath._capture = patched_capture(convert)
            fast.fast._plans.clear()
            CONVERTED.clear()
            ar = run(fast, prompts, "ar", 1, params)
            trees = [run(fast, prompts, "ddtree", b, params) for b in args.budgets]
            outs = [ar["outputs"]] + [t["outputs"] for t in trees]
            outputs.setdefault(convert, outs)
            same = outs == outputs[False]
            cells = " | ".join(f"{t['round_ms']:.3f}" for t in trees)
            label = "programmatic" if convert else "as captured"
            print(f"| {label} | {ar['round_ms']:.3f} | {cells} | {sum(CONVERTED)} | {same} |", flush=True)


if __name__ == "__main__":
    main()
