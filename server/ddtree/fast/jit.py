"""Whether the fast path's Triton kernels build and run on a device, checked once per device.

Triton compiles each kernel's launcher with the host's C compiler and Python headers at run time; an
image without them (or a Triton too old for `tl.topk`) must still serve. The first call runs every kernel
on tiny inputs; if that fails, the fast path uses PyTorch SDPA and the PyTorch tree loop instead, and
says why on stderr.

On the CPU the fast path takes its PyTorch code, unless a test turns INTERPRETED_ON_CPU on while Triton's
interpreter is on (TRITON_INTERPRET=1): then every kernel runs, interpreted, where the GPU would run it,
so a CPU machine checks how the kernels fit together (tests/fast/test_kernels_cpu.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # CPU-only installs
    triton = None

    class OutOfResources(Exception):
        """Stands in for Triton's error where Triton is missing (nothing raises it then)."""

try:  # grid dependency control (Triton 3.4 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_wait = gdc_launch_dependents = None

PDL = os.environ.get("DDTREE_PDL", "1") != "0"
EARLY_LAUNCH = frozenset() if os.environ.get("DDTREE_EARLY_LAUNCH") == "0" else frozenset(
    ("norm", "heads", "attention"))  # the steps that let the next kernel launch first (`early_pdl`)
_WORKS: dict[torch.device, bool] = {}
_FITTED: dict[tuple, dict[str, int]] = {}  # launch configs whose tiles outgrew a GPU's shared memory: their fit
INTERPRETED_ON_CPU = False


def triton_works(device: torch.device) -> bool:
    """Whether the fast path runs its Triton kernels on `device` (else its PyTorch code)."""
    if triton is None:
        return False
    if device.type == "cpu":
        return INTERPRETED_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda":
        return False
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _WORKS:
        try:
            _probe(device)
            _WORKS[device] = True
        except Exception as exc:  # a missing compiler, an old Triton: anything that stops the kernels
            reason = str(exc).splitlines()[0] if str(exc) else ""
            print(f"ddtree fast path: Triton kernels unavailable ({type(exc).__name__}: {reason}); "
                  "using SDPA and the PyTorch tree build", file=sys.stderr)
            _WORKS[device] = False
    return _WORKS[device]


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents (PDL; Hopper and later): a launch may
    start while the kernel before it drains, and its programs wait (`after_previous`) until that kernel has
    finished and its writes are visible. Back-to-back memory-bound kernels then overlap their ramps and
    tails. DDTREE_PDL=0 turns it off, for A/B runs."""
    return (PDL and gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1")


def early_pdl(device: torch.device, rows: int, step: str) -> int:
    """The PDL constant for a norm, heads or attention kernel (`step`) over `rows` rows: 2 (let the next kernel
    launch, then wait) where the next projection is our Hopper GEMM's (wgmma.py: 33-136 rows), else pdl(device).

    A programmatic dependent launches once every program of the kernel before it has let it. Our Hopper GEMM
    loads its first weight tiles before it waits, but after a norm it used to launch only once the projection
    before the norm had finished. Letting the next kernel launch first chains the launches: the next
    projection's blocks land, and load, on each SM the one before leaves, while the norm still waits. In one
    process a B = 64 round took 5.41 ms against 5.47 (RESULTS v31), most of it from the norms. Not before the
    few-row GEMM or the GEMV: their small blocks, landing beside a running kernel's, pack onto the SMs it frees
    first (a B = 16 round was 0.1 ms slower). DDTREE_EARLY_LAUNCH=0 turns it off; `EARLY_LAUNCH` names the
    steps that take it."""
    from ddtree.fast import wgmma  # (which imports this module)

    takes = wgmma.ENABLED and wgmma.MIN_ROWS <= rows <= wgmma.MAX_ROWS
    return 2 if pdl(device) and step in EARLY_LAUNCH and takes else int(pdl(device))


def program_block(n: int, device: torch.device, gpu: int) -> int:
    """How much of n one program takes: `gpu` on a GPU; interpreted on the CPU, all of it (a power of two), as
    a program there costs far more than its elements."""
    return triton.next_power_of_2(n) if device.type == "cpu" else gpu


def _probe(device: torch.device) -> None:
    """Every kernel on tiny inputs: a 2-row tree over an empty cache (in both loop forms, with and without a
    merge), a vocabulary top-2 and argmax, a budget-2 tree, a normed one-row GEMV, a two-row GEMM (with and
    without split K), one row's attention heads, a cache compaction, a row gather."""
    from ddtree.fast.attention import TreeMask, _triton_attention
    from ddtree.fast.cache import compact_on_gpu
    from ddtree.fast.gather import _gather
    from ddtree.fast.gemm import skinny_linear
    from ddtree.fast.gemv import NORM, gemv
    from ddtree.fast.heads import attention_heads
    from ddtree.fast.tree import _build_on_gpu, _frontier, _vocab_argmax_on_gpu, _vocab_top_on_gpu

    start = torch.zeros((), dtype=torch.long, device=device)
    mask = TreeMask(start, 2, None, visible=torch.ones(2, 2, dtype=torch.int8, device=device))
    q, cache = torch.zeros(1, 2, 16, device=device), torch.zeros(2, 1, 128, 16, device=device)
    for splits, two_loops in ((1, 0), (2, 1)):  # one split writes the output itself; more go through the merge
        _triton_attention(q, cache, mask, dict(block_m=16, block_n=64, splits=splits, num_warps=4, num_stages=2,
                                               two_loops=two_loops))
    logp, tokens = _vocab_top_on_gpu(torch.zeros(3, 20, device=device), 2, torch.arange(20, device=device))
    _vocab_argmax_on_gpu(torch.zeros(3, 20, device=device), 16)
    _build_on_gpu(logp, tokens, _frontier(2, 2, device), budget=2, n=2)
    row, ones = torch.zeros(1, 16, device=device), torch.ones(16, device=device)
    gemv(row, torch.zeros(16, 16, device=device), NORM, row, ones, 1e-6)
    for split_k in (1, 2):  # the second sums its partials in the last program
        skinny_linear(torch.zeros(2, 128, device=device), torch.zeros(64, 128, device=device),
                      dict(block_n=64, block_k=64, split_k=split_k, num_warps=4, num_stages=2))
    attention_heads(row, row, row, ones, ones, 1e-6, row, row, 1, 16, torch.zeros(2, 1, 4, 16, device=device),
                    torch.zeros(1, dtype=torch.long, device=device))
    compact_on_gpu(torch.zeros(2, 8, 16, device=device), start, torch.zeros(2, dtype=torch.long, device=device))
    _gather(ones.view(2, 8), torch.zeros(1, dtype=torch.long, device=device))
    torch.cuda.synchronize(device)


_DECLINED: set[tuple] = set()  # (kernel, shape...) whose Triton launch failed: the PyTorch code serves them


def attempt(key: tuple, launch: Callable[..., Any], *args: Any) -> Any:
    """`launch(*args)`, unless it failed before for this shape; None when it fails (this shape then takes the
    PyTorch path for good). A shape's first call is a warm-up, never inside a graph capture, and a failure
    to build or launch (too little shared memory on this GPU for a big budget) happens before any work."""
    if key in _DECLINED:
        return None
    try:
        return launch(*args)
    except Exception as exc:  # a compile error or OutOfResources from Triton
        _DECLINED.add(key)
        print(f"ddtree fast path: the {key[0]} kernel cannot run at {key[1:-1]} on this GPU "
              f"({type(exc).__name__}); using PyTorch for it", file=sys.stderr)
        return None


def launch_fitting(launch: Callable[[dict[str, int]], None], tiles: dict[str, int], shrink: tuple[str, int],
                   where: tuple) -> dict[str, int]:
    """launch(tiles), or launch with the largest tiles that fit this GPU's shared memory: Triton raises
    OutOfResources before it launches anything, and then tiles["num_stages"] drops to one, then the tile
    size shrink[0] halves, down to shrink[1]. Configs are tuned on an H200 (227 KB a block); float32
    operands, wider heads or a GPU with less shared memory (about 100 KB on a consumer card) can need less.
    The fit is remembered per `where` and starting tiles, so later calls (and graph captures, which follow
    a warm-up) launch it at once. Returns the tiles that ran."""
    key = (*where, *tiles.items())
    tiles = _FITTED.get(key, tiles)
    name, least = shrink
    while True:
        try:
            launch(tiles)
            return tiles
        except OutOfResources:
            if tiles["num_stages"] > 1:
                tiles = {**tiles, "num_stages": tiles["num_stages"] - 1}
            elif tiles[name] > least:
                tiles = {**tiles, name: tiles[name] // 2}
            else:
                raise
            _FITTED[key] = tiles


after_previous = None  # CPU-only installs: no kernels to order
if triton is not None:

    @triton.jit
    def after_previous(PDL: tl.constexpr):
        """A kernel's first step when launched with PDL (a no-op otherwise): wait for the kernel before it, then
        let the next one launch; PDL 2 (`early_pdl`): let the next one launch, then wait. Nothing may be read
        from or written to memory that another kernel writes or reads before this; constant weights may be."""
        if PDL == 2:
            gdc_launch_dependents()
            gdc_wait()
        elif PDL:
            gdc_wait()
            gdc_launch_dependents()
