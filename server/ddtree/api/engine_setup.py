"""Getting a loaded engine ready to serve: its batch engine, the sampling defaults, the warm-up that captures its
graphs before /ready says yes, and the start-up lines that say what it holds. Runs where the engine runs: in the
server's process, or in the engine process (api/engine_process.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ddtree.api.config import NEUTRAL_SAMPLING, ServerConfig, merged_sampling
from ddtree.core.sampling import SamplingParams
from ddtree.engine.batch import warm_up
from ddtree.kernels.fp8 import Fp8Weight
from ddtree.models.fp8_target import stored_bytes

log = logging.getLogger("ddtree.server")

CACHES = ("kv", "draft_kv", "conv_state", "recurrent_state")  # the static caches a decode path allocates


def set_up(config: ServerConfig, engine: Any) -> tuple[Any, dict[str, float]]:
    """The engine's batch engine, built and warmed up, and the sampling defaults; said in the log."""
    defaults = sampling_defaults(config, engine)
    batch = build_batch(config, engine)
    warm(engine, batch, defaults)
    log.info("serving %s (method %s, budget %s, max context %d)", config.served_model_name or engine.model_name,
             engine.method, engine.budget, engine.max_context)
    if note := getattr(engine, "fast_note", None):
        log.warning("%s", note)
    head = getattr(engine, "draft_head", None)
    if head is not None and head.token_ids is not None:
        log.info("drafting from %d of %d tokens (--draft-vocab)", head.size, engine.vocab_size)
    if quantized := getattr(engine, "draft_quantization", None):
        log.info("drafting in %s (--draft-quantization): the output stays the target's own", quantized)
    if isinstance(getattr(getattr(engine, "target", None), "model", None), torch.nn.Module):  # not a test fake
        log.info("%s", memory_line(engine, batch))
    return batch, defaults


def build_batch(config: ServerConfig, engine: Any) -> Any:
    """The batch engine requests decode in, and what it holds, said once."""
    started = time.perf_counter()
    batch = engine.batch(config.batch)
    kinds = ", ".join(backend.name for backend in batch.backends)
    if batch.blocks is not None:
        blocks = batch.blocks
        tokens = blocks.num_blocks * blocks.block_size
        log.info("KV cache: %d blocks of %d tokens (%d tokens; %.1f full-context requests at once)",
                 blocks.num_blocks, blocks.block_size, tokens, tokens / engine.max_context)
    log.info("continuous batching: up to %d requests and %d tokens a step (%s; set up in %.1f s)",
             batch.max_num_seqs, config.batch.max_num_batched_tokens, kinds, time.perf_counter() - started)
    cost = getattr(batch.backends[0], "cost", None) if batch.backends else None
    if cost is not None and len(cost.points) > 1:
        log.info("batch budget: round cost measured at %s verified tokens (%.2f-%.2f ms)",
                 ", ".join(str(t) for t, _ in cost.points[::4]), 1e3 * cost.points[0][1], 1e3 * cost.points[-1][1])
    return batch


def warm(engine: Any, batch: Any, defaults: dict[str, float]) -> None:
    """Capture the fast path's graphs before /ready says yes: for greedy requests and for requests that
    keep the default sampling settings (the two plans nearly every request runs on)."""
    if getattr(engine, "fast", None) is None:
        return
    log.info("warming up the fast path (CUDA graphs, compiled kernels) ...")
    started = time.perf_counter()
    try:
        settings = [SamplingParams(**merged_sampling(defaults, {}))]
        if not settings[0].greedy:
            settings.append(SamplingParams(**merged_sampling(defaults, {"temperature": 0.0})))
        done = engine.warm_up(*settings) if batch.max_num_seqs == 1 else warm_up(batch, *settings)
    except Exception as exc:  # an optimisation only: the first requests then capture what they need
        log.warning("fast path warm-up failed (%s: %s); the first requests will capture their graphs",
                    type(exc).__name__, exc)
        return
    log.info("fast path warmed up in %.1f s (%s)", time.perf_counter() - started, ", ".join(done) or "nothing")


def sampling_defaults(config: ServerConfig, engine: Any) -> dict[str, float]:
    """What requests that omit a sampling field get: --default-temperature, then (auto) the checkpoint's
    generation config, then the neutral values. Said once, as vLLM says it: replies change with it."""
    flag = {} if config.default_temperature is None else {"temperature": config.default_temperature}
    model = engine.generation_defaults if config.generation_config == "auto" else {}
    model = {k: v for k, v in model.items() if k not in flag}
    if model:
        log.info("default sampling parameters from the model's generation_config.json: %s (fields a request "
                 "sends win; --generation-config none ignores the file)",
                 ", ".join(f"{k}={v}" for k, v in model.items()))
    return {**NEUTRAL_SAMPLING, **model, **flag}


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
