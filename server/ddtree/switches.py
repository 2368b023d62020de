"""The fast path's escape hatches: the few switches a user may need, read once from the environment.

    DDTREE_PDL=0       launch each kernel only once the one before it has finished (no programmatic dependent
                       launches): for a driver or profiler that mishandles them
    DDTREE_WGMMA=0     a tree's projections through cuBLASLt instead of our Hopper GEMM (ddtree/kernels/wgmma.py)
    DDTREE_COMPILE=0   the fast path's elementwise steps run eagerly instead of as torch.compile's kernels: for a
                       machine where torch.compile cannot build
    DDTREE_DEVICE_ROUND=0  a batch's rounds take the host path (trees, walk and commit in Python) instead of
                       running whole on the device (fast/batch_round.py): for A/B runs
    DDTREE_OVERLAP=0   a batch's device round is read before the next is queued, instead of the next round running
                       while the host takes this one's results (fast/batch_round.py): for A/B runs
    DDTREE_PAGED_SPLIT=0  a batch's paged attention walks each sequence's keys in one program, never split along
                       them and merged (kernels/paged_attention.py): for A/B runs

Every other choice of kernel is made by what the device and the shapes support. Tests and A/B scripts change a
switch for a block of code with `override`; a CUDA graph captured before keeps what it captured, so an A/B
recaptures its plans after switching.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass
class Switches:
    pdl: bool = True
    wgmma: bool = True
    compile: bool = True
    device_round: bool = True
    overlap: bool = True
    paged_split: bool = True


def from_environment(environ: Mapping[str, str] = os.environ) -> Switches:
    """The switches as the environment sets them: each on unless its variable is "0"."""
    return Switches(**{f.name: environ.get(f"DDTREE_{f.name.upper()}", "1") != "0"
                       for f in dataclasses.fields(Switches)})


SWITCHES = from_environment()


@contextlib.contextmanager
def override(**changes: bool) -> Iterator[Switches]:
    """Set switches inside the block (`with override(pdl=False): ...`), restoring them after."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(Switches)}
    if unknown:
        raise TypeError(f"unknown switch(es): {', '.join(sorted(unknown))}")
    before = dataclasses.asdict(SWITCHES)
    for name, value in changes.items():
        setattr(SWITCHES, name, value)
    try:
        yield SWITCHES
    finally:
        for name, value in before.items():
            setattr(SWITCHES, name, value)
