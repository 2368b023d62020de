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

import torch

from ddtree.api.metrics import ServerMetrics
from ddtree.api.protocol import APIError
from ddtree.api.rendering import PromptRenderer
from ddtree.api.scheduler import Scheduler, SpecStats
from ddtree.core.sampling import SamplingParams
from ddtree.engine.batch import BatchOptions, warm_up
from ddtree.kernels.fp8 import Fp8Weight
from ddtree.models.fp8_target import stored_bytes

T = TypeVar("T")

log = logging.getLogger("ddtree.server")

# What a request that omits these fields gets without --default-temperature or the model's generation config.
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}




# --------------------------------------------------------------------------------------------------------
# Server state


@dataclass
class ServerConfig:
    """What `ddtree serve` decides before the model is loaded."""

    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 256
    drain_timeout: float = 30.0  # seconds queued and running requests get to finish at shutdown
    default_temperature: float | None = None  # for requests that send none; None: the model's, else OpenAI's 1.0
    generation_config: str = "auto"  # auto: the checkpoint's sampling defaults (vLLM's); none / vllm: ignore them
    # Chat template arguments every chat gets unless it sends its own, e.g. {"enable_thinking": False}:
    # Qwen3's DFlash drafters were trained on replies without thinking, so thinking costs acceptance.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str = "auto"  # auto: hermes when the chat template writes <tool_call> blocks; hermes; none
    batch: BatchOptions = field(default_factory=BatchOptions)  # continuous batching: sequences, tokens, memory
    reasoning_parser: str = "auto"  # auto: qwen3 when the chat template knows </think>; qwen3; none
    max_request_bytes: int = 4 * 2**20  # larger bodies get a 413 before they are read
    escape_special_tokens: bool = True  # special-token text in chat messages is plain text, never a role marker
    docs: bool = True  # /docs, /redoc and /openapi.json (behind the API key when there is one)
    prepare_workers: int = 8  # threads that parse, render and tokenize requests off the event loop


CACHES = ("kv", "draft_kv", "conv_state", "recurrent_state")  # the static caches a decode path allocates


def memory_line(engine: Any, batch: Any) -> str:
    """What the device holds, by use: the target's weights (in its format), the drafter's (and a draft head's own
    rows), and the K/V and recurrent caches of the fast path and the batch backends."""
    target, draft, head = engine.target, engine.draft, engine.draft_head
    drafter = stored_bytes(draft) if draft is not None else 0
    if head is not None and not (isinstance(head.weight, torch.Tensor)
                                 and head.weight.data_ptr() == target.lm_head.weight.data_ptr()):
        weight = head.weight
        drafter += weight.nbytes if isinstance(weight, Fp8Weight) else weight.numel() * weight.element_size()
    caches = {}
    for holder in (getattr(engine, "fast", None), *getattr(batch, "backends", ())):
        for name in CACHES:
            tensor = getattr(holder, name, None)
            if isinstance(tensor, torch.Tensor):
                caches[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    fmt = target.quantization or str(target.dtype).removeprefix("torch.")
    return (f"memory: target weights {stored_bytes(target.model) / 1e9:.2f} GB ({fmt}), drafter "
            f"{drafter / 1e9:.2f} GB, KV and recurrent caches {sum(caches.values()) / 1e9:.2f} GB")


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

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the worker pool: parsing, template rendering and tokenization take time that
        grows with the request, and on the event loop they would hold up every other client and /health."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.config.prepare_workers, thread_name_prefix="ddtree-prepare")
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

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
        """Stop the engine worker and the pool (after the drain: nothing is left for them)."""
        if self.scheduler is not None:
            self.scheduler.shutdown(timeout)
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def load(self, load_engine: Callable[[], Any]) -> None:
        """Load the engine and start the scheduler (runs in a thread; the server answers meanwhile)."""
        engine = load_engine()
        name = self.config.served_model_name or engine.model_name
        budget = engine.budget if engine.method == "ddtree" else None
        metrics = ServerMetrics(name, method=engine.method, budget=budget, block_size=engine.block_size,
                                max_model_len=engine.max_context)
        self.sampling_defaults = self._sampling_defaults(engine)
        batch = self._batch(engine)
        self._warm_up(engine, batch)
        if engine.tokenizer is not None:
            self.prompts = PromptRenderer(engine, escape_special_tokens=self.config.escape_special_tokens)
        self.engine, self.model_name, self.metrics = engine, name, metrics
        budget = engine.budget if engine.method == "ddtree" else None  # only trees have one
        self.scheduler = Scheduler(batch, engine.decode, metrics, max_queue=self.config.max_queue,
                                   eos_token_ids=engine.eos_token_ids,
                                   spec=lambda: SpecStats(engine.method, budget, engine.block_size))
        log.info("serving %s (method %s, budget %s, max context %d)", name, engine.method, engine.budget,
                 engine.max_context)
        if note := getattr(engine, "fast_note", None):
            log.warning("%s", note)
        head = getattr(engine, "draft_head", None)
        if head is not None and head.token_ids is not None:
            log.info("drafting from %d of %d tokens (--draft-vocab)", head.size, engine.vocab_size)
        if quantized := getattr(engine, "draft_quantization", None):
            log.info("drafting in %s (--draft-quantization): the output stays the target's own", quantized)
        if isinstance(getattr(getattr(engine, "target", None), "model", None), torch.nn.Module):  # not a test fake
            log.info("%s", memory_line(engine, batch))

    def _batch(self, engine: Any) -> Any:
        """The batch engine requests decode in, and what it holds, said once."""
        started = time.perf_counter()
        batch = engine.batch(self.config.batch)
        kinds = ", ".join(backend.name for backend in batch.backends)
        if batch.blocks is not None:
            blocks = batch.blocks
            tokens = blocks.num_blocks * blocks.block_size
            log.info("KV cache: %d blocks of %d tokens (%d tokens; %.1f full-context requests at once)",
                     blocks.num_blocks, blocks.block_size, tokens, tokens / engine.max_context)
        log.info("continuous batching: up to %d requests and %d tokens a step (%s; set up in %.1f s)",
                 batch.max_num_seqs, self.config.batch.max_num_batched_tokens, kinds, time.perf_counter() - started)
        cost = getattr(batch.backends[0], "cost", None) if batch.backends else None
        if cost is not None and len(cost.points) > 1:
            log.info("batch budget: round cost measured at %s verified tokens (%.2f-%.2f ms)",
                     ", ".join(str(t) for t, _ in cost.points[::4]), 1e3 * cost.points[0][1], 1e3 * cost.points[-1][1])
        return batch

    def _warm_up(self, engine: Any, batch: Any) -> None:
        """Capture the fast path's graphs before /ready says yes: for greedy requests and for requests that
        keep the default sampling settings (the two plans nearly every request runs on)."""
        if getattr(engine, "fast", None) is None:
            return
        log.info("warming up the fast path (CUDA graphs, compiled kernels) ...")
        started = time.perf_counter()
        try:
            settings = [SamplingParams(**merged_sampling(self.sampling_defaults, {}))]
            if not settings[0].greedy:
                settings.append(SamplingParams(**merged_sampling(self.sampling_defaults, {"temperature": 0.0})))
            done = engine.warm_up(*settings) if batch.max_num_seqs == 1 else warm_up(batch, *settings)
        except Exception as exc:  # an optimisation only: the first requests then capture what they need
            log.warning("fast path warm-up failed (%s: %s); the first requests will capture their graphs",
                        type(exc).__name__, exc)
            return
        log.info("fast path warmed up in %.1f s (%s)", time.perf_counter() - started, ", ".join(done) or "nothing")

    def _sampling_defaults(self, engine: Any) -> dict[str, float]:
        """What requests that omit a sampling field get: --default-temperature, then (auto) the checkpoint's
        generation config, then the neutral values. Said once, as vLLM says it: replies change with it."""
        flag = {} if self.config.default_temperature is None else {"temperature": self.config.default_temperature}
        model = engine.generation_defaults if self.config.generation_config == "auto" else {}
        model = {k: v for k, v in model.items() if k not in flag}
        if model:
            log.info("default sampling parameters from the model's generation_config.json: %s (fields a request "
                     "sends win; --generation-config none ignores the file)",
                     ", ".join(f"{k}={v}" for k, v in model.items()))
        return {**NEUTRAL_SAMPLING, **model, **flag}

    def require_ready(self) -> Scheduler:
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="service_unavailable")
        if self.load_error is not None:
            raise APIError(503, f"The model could not be loaded: {self.load_error}", type="service_unavailable")
        if self.scheduler is None:
            raise APIError(503, "The model is still loading.", type="service_unavailable",
                           headers={"Retry-After": "5"})
        return self.scheduler


def merged_sampling(defaults: dict[str, float], sent: dict[str, float]) -> dict[str, float]:
    """The sampling fields a request runs with: what it sent over the server's defaults, top_k -1 and 0 both
    meaning off."""
    merged = {**defaults, **sent}
    return {**merged, "top_k": max(0, merged["top_k"])}
