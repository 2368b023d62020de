"""The scheduler on the event loop, for an engine in a process of its own.

With the engine apart (api/engine_process.py), the front end has nothing to wait on but the engine's pipe, so it
needs no worker thread: the event loop watches the pipe and takes each step's message as it comes, admits a
request the moment it is submitted (its `add` goes out at once and the engine takes it before its next step),
and hands outputs straight to the waiting coroutines. Why: a thread between the loop and the pipe cost a
hand-off under the interpreter lock on every request's way in and every step's way out, about 1 ms of a lone
request's first token on a 2-core host (benchmarks/RESULTS.md), and it admitted requests only between steps.
vLLM's AsyncLLM reads its engine core from the event loop the same way.

The scheduling itself (fair queue, admission, stop strings, metrics) is `Scheduler`'s; only the driving differs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from ddtree.api.engine_process import EngineFailed, RemoteBatch
from ddtree.api.metrics import ServerMetrics
from ddtree.api.scheduler import Output, Request, Scheduler


class LoopScheduler(Scheduler):
    """`Scheduler` driven by the event loop's readiness callbacks on the engine process's pipe."""

    def __init__(self, batch: RemoteBatch, decode: Callable[[list[int]], str], metrics: ServerMetrics, *,
                 loop: asyncio.AbstractEventLoop, **options: Any) -> None:
        self._event_loop = loop
        self._watching = False
        super().__init__(batch, decode, metrics, **options)

    def _start(self) -> None:
        """Watch the pipe (this runs in the loading thread: the loop adds the watch itself)."""
        self._event_loop.call_soon_threadsafe(self._watch)

    def _watch(self) -> None:
        self._event_loop.add_reader(self.batch.conn.fileno(), self._pump)
        self._watching = True
        self._pump()  # a message may have come before the watch

    def _unwatch(self) -> None:
        if self._watching:
            self._event_loop.remove_reader(self.batch.conn.fileno())
            self._watching = False

    def _stop(self) -> None:
        """After the drain (from the closing thread): nothing is admitted any more and the pipe is left alone."""
        self.queue.close()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing watches any more
            self._event_loop.call_soon_threadsafe(self._unwatch)

    def submit(self, request: Request) -> None:
        super().submit(request)
        self._pump()

    def cancel(self, request: Request) -> None:
        """The client went away: a running request is freed in the engine now, before the engine's next step
        (the worker thread could only do it between steps)."""
        super().cancel(request)
        self._end_running([run for run in self._running.values() if run.request is request], None)

    def abort_all(self, reason: str) -> None:
        super().abort_all(reason)
        self._end_running(list(self._running.values()), reason)

    def _end_running(self, runs: list, error: str | None) -> None:
        for run in runs:
            self.batch.abort(run.sequence)
            self._retire(run, Output("", [], None, finish_reason="abort", error=error, retryable=error is not None))
        Request.post_all(self._posts)
        self._posts.clear()

    def _next_waiting(self) -> Request | None:
        return self.queue.get(block=False)

    def _pump(self) -> None:
        """Admit what waits, then take every step the engine has sent (admitting between them); once the engine
        is gone, its running requests end with the error and the pipe is no longer watched."""
        self._admit()
        while self.batch.step_ready():
            if self._running:
                self._step()
            elif self.batch.gone:
                self._unwatch()
                return
            else:  # only requests this side has already ended ran in it
                with contextlib.suppress(EngineFailed):
                    self.batch.step()
            self._admit()
