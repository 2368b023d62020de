"""What `ddtree serve` decides before the model is loaded, and the sampling defaults requests fall back on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddtree.engine.batch import BatchOptions

# What a request that omits these fields gets without --default-temperature or the model's generation config.
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


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
    # The engine (models, batch engine, steps) in a process of its own (api/engine_process.py): the loader must
    # then be picklable. Off: it steps in a thread of this process (tests with stand-in engines).
    engine_process: bool = False


def merged_sampling(defaults: dict[str, float], sent: dict[str, float]) -> dict[str, float]:
    """The sampling fields a request runs with: what it sent over the server's defaults, top_k -1 and 0 both
    meaning off."""
    merged = {**defaults, **sent}
    return {**merged, "top_k": max(0, merged["top_k"])}
