"""A fast-path round's steps replayed as CUDA graphs (or run eagerly), and the queued round the host reads back.

Split from fast/runner.py, which builds the steps: this module only launches them, stamps their times and
copies their result out in stream order, so the host can prepare the next round while the device runs this one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch


class Plan:
    """One (method, budget)'s round: its steps, replayed from their CUDA graphs when captured, else run eagerly.

    A capture that fails (an op that cannot be captured on this torch build) leaves the whole plan eager,
    on the same static buffers, with the reason in `eager_reason`: slower, never wrong.
    """

    def __init__(self, steps: list[tuple[str, Callable]], capture: Callable | None, cuda: bool,
                 noise: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> None:
        self.steps, self.cuda, self.noise, self.allowed = steps, cuda, noise, allowed
        self.outputs: dict[str, object] = {}  # each step's latest output (static buffers once captured)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.result: tuple[torch.Tensor, ...] = ()  # the verify's outputs the host reads: result, logprob rows
        self.eager_reason = None if capture is not None else "graphs off"
        if capture is not None:
            out = None
            try:
                for name, fn in steps:
                    graph, out = capture(fn, out)
                    self.graphs.append(graph)
                    self.outputs[name] = out
                    if name == "verify":
                        self.result = _read_back(out)
            except RuntimeError as exc:
                self.graphs, self.eager_reason = [], f"capture failed: {str(exc).splitlines()[0]}"
                print(f"ddtree fast path: {self.eager_reason}; running eagerly", file=sys.stderr)

    def launch(self, before_verify: Callable[[], object] | None = None,
               after: torch.cuda.Event | float | None = None) -> Launched:
        """Queue one round (run it, off CUDA) and a copy of its result to the host; read it with collect().

        `before_verify` runs eagerly just before the verify step (a sampled plan's noise refill, a constrained
        one's masks), inside its timing. `after` is the previous round's last stamp: the gap from it is the
        device's wait for the host.
        """
        stamps: list = []
        out = None
        result = self.result
        stream = torch.cuda.current_stream() if self.cuda else None  # looked up once: it costs the host ~10 us
        for i, (name, fn) in enumerate(self.steps):
            stamps.append(stamp(self.cuda, stream))
            if name == "verify" and before_verify is not None:
                before_verify()
            if self.graphs:
                self.graphs[i].replay()
            else:
                out = self.outputs[name] = fn(out)
                result = _read_back(out) if name == "verify" else result
        stamps.append(stamp(self.cuda, stream))
        if self.cuda:  # the next round's verify overwrites these buffers: copy them out in stream order
            result = tuple(t.to("cpu", non_blocking=True) for t in result)
        stamps.append(stamp(self.cuda, stream))
        return Launched(self.steps, stamps, after, result)

    def run(self, before_verify: Callable[[], object] | None = None) -> tuple[list[int], dict[str, float]]:
        """One round, read back at once: ([accepted length, emitted tokens...], seconds per step)."""
        return self.launch(before_verify).collect()


class Launched:
    """A queued round: its step stamps and its result (with its logprob rows, if any) on the way to the host."""

    def __init__(self, steps: list[tuple[str, Callable]], stamps: list, after: torch.cuda.Event | float | None,
                 result: tuple[torch.Tensor, ...]) -> None:
        self.steps, self.stamps, self.after = steps, stamps, after
        self.result, self.logprob_rows = result[0], result[1:] or None

    def collect(self) -> tuple[list[int], dict[str, float]]:
        """Wait for the round; returns ([accepted length, emitted tokens...], seconds per step and `host`)."""
        if isinstance(self.stamps[-1], torch.cuda.Event):
            self.stamps[-1].synchronize()  # the round's one synchronisation
        spans = zip(self.steps, self.stamps[:-2], self.stamps[1:-1], strict=True)
        phases = {name: _elapsed(a, b) for (name, _), a, b in spans}
        waited = 0.0 if self.after is None else _elapsed(self.after, self.stamps[0])
        phases["host"] = waited + _elapsed(self.stamps[-2], self.stamps[-1])  # idle device + the result's copy
        return self.result.tolist(), phases


def _read_back(verified: tuple) -> tuple[torch.Tensor, ...]:
    """What the host reads of a verify's outputs: the result, then the logprob rows when the plan has them."""
    return (verified[0], *(verified[5] or ()))


def now(wait: bool) -> float:
    """The host's clock; `wait`: once the device has finished what was queued."""
    if wait:
        torch.cuda.synchronize()
    return time.perf_counter()


def lap(t: float, wait: bool) -> tuple[float, float]:
    """(seconds since `t`, now): `now`'s."""
    at = now(wait)
    return at - t, at


def stamp(cuda: bool, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | float:
    """A point in the device's timeline (on `stream`, by default the current one), or the host's off CUDA."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _elapsed(a: torch.cuda.Event | float, b: torch.cuda.Event | float) -> float:
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3
