"""Whether the fast path's Triton kernels build and run on a device, checked once per device.

Triton compiles each kernel's launcher with the host's C compiler and Python headers at run time; an
image without them (or a Triton too old for `tl.topk`) must still serve. The first call runs every kernel
on tiny inputs; if that fails, the fast path uses PyTorch SDPA and the PyTorch tree loop instead, and
says why on stderr.

Each kernel module registers its own smoke test with `probe`, so this module imports none of them. On the CPU the
fast path takes its PyTorch code, unless a test turns INTERPRETED_ON_CPU on while Triton's
interpreter is on (TRITON_INTERPRET=1): then every kernel runs, interpreted, where the GPU would run it,
so a CPU machine checks how the kernels fit together (tests/kernels/ and tests/fast/test_interpreted.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ddtree.switches import SWITCHES

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

_WORKS: dict[torch.device, bool] = {}
_PROBES: list[Callable[[torch.device], object]] = []  # every kernel module's smoke test (`probe`)
_PROBED: dict[torch.device, int] = {}  # how many of them have run on each device
_FITTED: dict[tuple, dict[str, int]] = {}  # launch configs whose tiles outgrew a GPU's shared memory: their fit
INTERPRETED_ON_CPU = False


def probe(test: Callable[[torch.device], object]) -> Callable[[torch.device], object]:
    """Register a kernel module's smoke test: its kernels launched once on tiny inputs, through their direct
    launchers (not through anything that asks `triton_works`). Used as a decorator."""
    _PROBES.append(test)
    return test


def triton_works(device: torch.device) -> bool:
    """Whether the fast path runs its Triton kernels on `device` (else its PyTorch code): every registered
    smoke test has run there without an error (tests registered later run at the next call)."""
    if triton is None:
        return False
    if device.type == "cpu":
        return INTERPRETED_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda":
        return False
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    done = _PROBED.get(device, 0)
    if done < len(_PROBES) and _WORKS.get(device, True):
        _PROBED[device] = len(_PROBES)
        try:
            for test in _PROBES[done:]:
                test(device)
            torch.cuda.synchronize(device)
            _WORKS[device] = True
        except Exception as exc:  # a missing compiler, an old Triton: anything that stops the kernels
            reason = str(exc).splitlines()[0] if str(exc) else ""
            print(f"ddtree fast path: Triton kernels unavailable ({type(exc).__name__}: {reason}); "
                  "using SDPA and the PyTorch tree build", file=sys.stderr)
            _WORKS[device] = False
    return _WORKS.get(device, True)


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents (PDL; Hopper and later): a launch may
    start while the kernel before it drains, and its programs wait (`after_previous`) until that kernel has
    finished and its writes are visible. Back-to-back memory-bound kernels then overlap their ramps and
    tails. DDTREE_PDL=0 turns it off (ddtree.switches)."""
    return (SWITCHES.pdl and gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1")


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors a launch fills; interpreted on the CPU, 4 (so split launches still split)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def program_block(n: int, device: torch.device, gpu: int) -> int:
    """How much of n one program takes: `gpu` on a GPU; interpreted on the CPU, all of it (a power of two), as
    a program there costs far more than its elements."""
    return triton.next_power_of_2(n) if device.type == "cpu" else gpu


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
