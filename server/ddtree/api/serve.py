"""`ddtree serve`: uvicorn around the API app, with a SIGTERM drain.

On SIGTERM (or Ctrl-C) the server reports not-ready and refuses new work with a 503 while it keeps
listening (probes get an answer, not a refused connection), lets every in-flight request finish (up to the
drain timeout), ends what is left with a 503 (streams: an error event, then [DONE]), and only then closes
the listener, stops the engine worker and exits with status 0: a rolling update loses no request silently.
A second signal skips the drain.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from dataclasses import dataclass, field

import uvicorn

from ddtree.api.app import create_app
from ddtree.api.config import ServerConfig
from ddtree.api.state import ServerState
from ddtree.engine.batch import BatchOptions

# How long a thread may hold the GIL while another waits for it. The engine worker and the event loop share one
# interpreter: each time the worker waits for the device it lets the GIL go, and it gets it back only when the loop
# (encoding and writing replies) gives it up, at CPython's default of 5 ms at the latest. A batched round waits
# for the device two or three times, so on a small model the served round took 3-4x its in-process time; at
# 0.5 ms the worker is back within half a millisecond and the loop still writes whole replies between turns.
SWITCH_INTERVAL_S = 0.0005


@dataclass
class ServeOptions:
    target: str | None = None
    draft: str | None = None
    shape: str | None = None  # a random-weight model of this shape (models/shapes.py) instead of a checkpoint
    draft_vocab: str | None = None  # a draft vocabulary file (ddtree.draft_vocab); None: the whole vocabulary
    draft_quantization: str | None = None  # "fp8": the drafter's projections in fp8 (ddtree.quantize)
    quantization: str | None = None  # "fp8": a bf16 target's projections quantized on load (models/fp8_target.py)
    method: str = "ddtree"
    budget: int | None = None
    device: str | None = None
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 256
    drain_timeout: float = 30.0
    default_temperature: float | None = None  # None: the model's generation config, else 1.0
    generation_config: str = "auto"  # auto | none | vllm (= none)
    fast: bool | None = None  # None: on when the model runs on CUDA
    tool_call_parser: str = "auto"  # auto | hermes | none
    reasoning_parser: str = "auto"  # auto | qwen3 | none
    default_chat_template_kwargs: dict = field(default_factory=dict)
    batch: BatchOptions = field(default_factory=BatchOptions)  # continuous batching
    max_request_bytes: int = 4 * 2**20
    escape_special_tokens: bool = True
    docs: bool = True
    engine_process: bool = True  # the models and their steps in a process of their own (api/engine_process.py)
    log_level: str = "info"


class _DrainingServer(uvicorn.Server):
    """uvicorn with the drain in front of its shutdown: the first signal starts the drain (the listener stays
    open meanwhile) and uvicorn's own shutdown begins when it is over, with nothing left to cancel."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.ddtree_state = state
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        """A signal handler (it runs on the event loop's thread, between two of its steps): only flags."""
        if self.ddtree_state.draining:
            super().handle_exit(sig, frame)  # the second signal: stop now
        self.ddtree_state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.ddtree_state.draining and self._drain is None:
            self._drain = asyncio.create_task(self.ddtree_state.drain())
        if self._drain is not None and self._drain.done():
            self.should_exit = True
        return await super().on_tick(counter)


def run(options: ServeOptions) -> int:
    """Serve until a signal; raises the engine's load error (a DDTreeError for user mistakes)."""
    from ddtree.engine import Engine

    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    failures: list[BaseException] = []

    # A partial, not a closure: the engine process gets it pickled.
    models = ((Engine.from_shape, options.shape) if options.shape is not None
              else (Engine.from_pretrained, options.target, options.draft))
    load = functools.partial(*models, method=options.method, budget=options.budget, device=options.device,
                             dtype=options.dtype, fast=options.fast, draft_vocab=options.draft_vocab,
                             draft_quantization=options.draft_quantization, quantization=options.quantization)

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    config = ServerConfig(served_model_name=options.served_model_name, api_key=options.api_key,
                          max_queue=options.max_queue, drain_timeout=options.drain_timeout,
                          default_temperature=options.default_temperature,
                          generation_config=options.generation_config,
                          tool_call_parser=options.tool_call_parser, reasoning_parser=options.reasoning_parser,
                          default_chat_template_kwargs=options.default_chat_template_kwargs, batch=options.batch,
                          max_request_bytes=options.max_request_bytes,
                          escape_special_tokens=options.escape_special_tokens, docs=options.docs,
                          engine_process=options.engine_process)
    app = create_app(load, config, on_load_error)
    # The drain has ended every request before uvicorn's shutdown starts: its grace period is for replies
    # still being written to slow clients.
    uv_config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                               timeout_graceful_shutdown=5)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = _DrainingServer(uv_config, app.state.ddtree)
    server.run()
    if failures:
        raise failures[0]
    return 0
