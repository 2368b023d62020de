"""What the handlers share: the server's configuration, the engine once loaded (warmed up before /ready says
yes), its scheduler and metrics, the sampling defaults requests that omit a field get, the worker pool requests
are parsed and tokenized in, and the drain that ends the server's work at shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ddtree.api import engine_process
from ddtree.api.config import NEUTRAL_SAMPLING, ServerConfig
from ddtree.api.engine_setup import set_up
from ddtree.api.loop_scheduler import LoopScheduler
from ddtree.api.metrics import ServerMetrics
from ddtree.api.protocol import APIError
from ddtree.api.rendering import PromptRenderer
from ddtree.api.scheduler import Scheduler, SpecStats

T = TypeVar("T")

log = logging.getLogger("ddtree.server")

INLINE_BODY_BYTES = 4096  # a body up to this size is prepared on the event loop (a prompt of ~1,000 tokens)

# --------------------------------------------------------------------------------------------------------
# Server state


@dataclass
class ServerState:
    """Everything the handlers share; the engine fields fill in once loading finishes."""

    config: ServerConfig
    engine: Any = None
    scheduler: Scheduler | None = None
    metrics: ServerMetrics | None = None
    model_name: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    load_error: str | None = None
    sampling_defaults: dict[str, float] = field(default_factory=lambda: dict(NEUTRAL_SAMPLING))
    prompts: PromptRenderer | None = None  # prompt text -> ids, once a tokenizer is loaded
    in_flight: int = 0  # API requests being served (middleware.InFlight); the drain waits for none
    pool: ThreadPoolExecutor | None = None

    async def prepare(self, fn: Callable[[ServerState, bytes], T], raw: bytes) -> T:
        """`fn(self, raw)`: parse, render and tokenize a request body. A small body is prepared on the event loop,
        where its work costs less than a hop to the pool and back (about 0.5 ms of a lone request's first token);
        a larger one in the worker pool, since the work grows with the body and on the loop it would hold up
        every other client and /health."""
        if len(raw) <= INLINE_BODY_BYTES:
            return fn(self, raw)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.config.prepare_workers, thread_name_prefix="ddtree-prepare")
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, self, raw))

    async def drain(self) -> None:
        """Finish the work in flight before the server stops: from now on /ready says 503 and new requests get
        a 503; those in flight get up to --drain-timeout seconds, then whatever is unfinished ends with a 503
        (a stream: an error event, then [DONE]) so no client is left with a cut connection."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        if self.in_flight:
            log.info("draining: %d request(s) in flight, up to %g s to finish (--drain-timeout)", self.in_flight,
                     self.config.drain_timeout)
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.in_flight and self.scheduler is not None:
            log.warning("drain timeout: ending %d unfinished request(s) with a 503", self.in_flight)
            self.scheduler.abort_all("The server shut down before the request finished (drain timeout); "
                                     "retry it.")
            deadline = loop.time() + 10  # the engine ends them at its next round
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.02)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine worker (and the engine process) and the pool (after the drain: nothing is left for them)."""
        if self.scheduler is not None:
            self.scheduler.shutdown(timeout)
            if isinstance(self.scheduler.batch, engine_process.RemoteBatch):
                self.scheduler.batch.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def load(self, load_engine: Callable[[], Any], loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Load the engine and start the scheduler (runs in a thread; the server answers meanwhile): in the engine
        process when the config says so, its steps taken on `loop` (the server's event loop), else here, stepped
        by the scheduler's worker thread."""
        if self.config.engine_process:
            engine, batch, self.sampling_defaults = engine_process.start(load_engine, self.config,
                                                                         logging.getLogger().getEffectiveLevel())
        else:
            engine = load_engine()
            batch, self.sampling_defaults = set_up(self.config, engine)
        name = self.config.served_model_name or engine.model_name
        budget = engine.budget if engine.method == "ddtree" else None  # only trees have one
        metrics = ServerMetrics(name, method=engine.method, budget=budget, block_size=engine.block_size,
                                max_model_len=engine.max_context)
        if engine.tokenizer is not None:
            self.prompts = PromptRenderer(engine, escape_special_tokens=self.config.escape_special_tokens)
        self.engine, self.model_name, self.metrics = engine, name, metrics
        options = dict(max_queue=self.config.max_queue, eos_token_ids=engine.eos_token_ids,
                       spec=lambda: SpecStats(engine.method, budget, engine.block_size))
        if isinstance(batch, engine_process.RemoteBatch) and loop is not None:
            self.scheduler = LoopScheduler(batch, engine.decode, metrics, loop=loop, **options)
        else:
            self.scheduler = Scheduler(batch, engine.decode, metrics, **options)

    @property
    def engine_failed(self) -> bool:
        """The engine process is gone: the server cannot serve again (liveness says so, to be restarted)."""
        batch = self.scheduler.batch if self.scheduler is not None else None
        return batch is not None and getattr(batch, "alive", True) is False

    def require_ready(self) -> Scheduler:
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="service_unavailable")
        if self.load_error is not None:
            raise APIError(503, f"The model could not be loaded: {self.load_error}", type="service_unavailable")
        if self.scheduler is None:
            raise APIError(503, "The model is still loading.", type="service_unavailable",
                           headers={"Retry-After": "5"})
        return self.scheduler
