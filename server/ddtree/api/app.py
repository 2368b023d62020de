"""The OpenAI-compatible HTTP API: request schemas and validation, responses, SSE streaming, errors.

Shaped like vLLM's and SGLang's OpenAI servers so their clients and benchmarks work unchanged, but kept
small: one engine, one served model, one sequence per request. Every error a client can cause comes back
as the OpenAI envelope `{"error": {"message", "type", "param", "code"}}` with the right status code.
Requests are validated here (on the event loop, cheaply) before they reach the engine's worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree import __version__
from ddtree.api.metrics import ServerMetrics
from ddtree.api.parsers.reasoning import CLOSE as REASONING_CLOSE
from ddtree.api.parsers.reasoning import OPEN as REASONING_OPEN
from ddtree.api.parsers.tools import START as TOOL_CALL_START
from ddtree.api.parsers.tools import forced_call_grammar, template_message
from ddtree.api.replies import ReplyFormat, ReplyStream, finish_reason, template_mentions
from ddtree.api.scheduler import Draining, Output, QueueFull, Scheduler
from ddtree.api.scheduler import Request as EngineRequest
from ddtree.core import grammar
from ddtree.core.sampling import MAX_TOP_LOGPROBS, SamplingParams, ThinkBlock
from ddtree.errors import DDTreeError

log = logging.getLogger("ddtree.server")

MAX_LOGPROBS = MAX_TOP_LOGPROBS
MAX_CHOICES = 128  # OpenAI's limit on n
# What a request that omits these fields gets without --default-temperature or the model's generation config.
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# JSON has no -inf; vLLM reports filtered-out alternatives with this value.
MIN_LOGPROB = -9999.0


# --------------------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An error to return as the OpenAI envelope."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_UNION_TAGS = {"str", "int", "float", "bool", "ContentPart", "ChatMessage"}


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as an OpenAI 400 naming the first offending field."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"Invalid JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members show up as extra path parts (`stop.str`, `prompt.list[int]`): keep the field path.
    loc = [part for part in loc if part not in _UNION_TAGS and "[" not in part]
    param = ".".join(loc) or None
    if param is None and first.get("type") == "model_attributes_type":
        return bad_request("The request body must be a JSON object (sent with Content-Type: application/json).")
    message = first.get("msg", "invalid request")
    return bad_request(f"{param}: {message}" if param else message, param)


# --------------------------------------------------------------------------------------------------------
# Request schemas (unknown fields are tolerated and logged, as OpenAI clients send vendor extras)


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Tolerant):
    include_usage: bool = False


class ContentPart(_Tolerant):
    type: str
    text: str | None = None


class ChatMessage(_Tolerant):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None


class _SamplingFields(_Tolerant):
    """Fields shared by chat and completions, OpenAI's plus vLLM's extensions (sent via `extra_body`)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # vLLM's, non-streaming
    user: str | None = None
    return_token_ids: bool = False
    return_spec_stats: bool = False
    # Structured outputs: OpenAI's `response_format` (vLLM takes it on completions too), vLLM's newer
    # `structured_outputs` object, or its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Tolerant):
    """vLLM's /tokenize: a completions `prompt` or chat `messages` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as the chat endpoint renders them (tool_choice too)
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Tolerant):
    model: str | None = None
    tokens: list[int]


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
    reasoning_parser: str = "auto"  # auto: qwen3 when the chat template knows </think>; qwen3; none


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

    def load(self, load_engine: Callable[[], Any]) -> None:
        """Load the engine and start the scheduler (runs in a thread; the server answers meanwhile)."""
        engine = load_engine()
        name = self.config.served_model_name or engine.model_name
        budget = engine.budget if engine.method == "ddtree" else None
        metrics = ServerMetrics(name, method=engine.method, budget=budget, block_size=engine.block_size,
                                max_model_len=engine.max_context)
        self.sampling_defaults = self._sampling_defaults(engine)
        self._warm_up(engine)
        self.engine, self.model_name, self.metrics = engine, name, metrics
        self.scheduler = Scheduler(engine, metrics, max_queue=self.config.max_queue)
        log.info("serving %s (method %s, budget %s, max context %d)", name, engine.method, engine.budget,
                 engine.max_context)
        if note := getattr(engine, "fast_note", None):
            log.warning("%s", note)
        head = getattr(engine, "draft_head", None)
        if head is not None and head.token_ids is not None:
            log.info("drafting from %d of %d tokens (--draft-vocab)", head.size, engine.vocab_size)
        if quantized := getattr(engine, "draft_quantization", None):
            log.info("drafting in %s (--draft-quantization): the output stays the target's own", quantized)

    def _warm_up(self, engine: Any) -> None:
        """Capture the fast path's graphs before /ready says yes: for greedy requests and for requests that
        keep the default sampling settings (the two plans nearly every request runs on)."""
        if getattr(engine, "fast", None) is None:
            return
        log.info("warming up the fast path (CUDA graphs, compiled kernels) ...")
        started = time.perf_counter()
        try:
            settings = [SamplingParams(**_merged_sampling(self.sampling_defaults, {}))]
            if not settings[0].greedy:
                settings.append(SamplingParams(**_merged_sampling(self.sampling_defaults, {"temperature": 0.0})))
            done = engine.warm_up(*settings)
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


# --------------------------------------------------------------------------------------------------------
# Validation: request -> prompt ids, sampling params, stop strings


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    prompt_text: str = ""
    reply: ReplyFormat = field(default_factory=ReplyFormat)  # how a chat reply splits (reasoning, tool calls)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of an n > 1 request: with a seed, seed + index, so the choices differ and the reply
    is still reproducible; without one, each choice draws its own randomness."""
    if index == 0 or params.seed is None:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)


def _check_token_ids(ids: list[int], vocab: int, what: str, param: str) -> None:
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"{what} must be token ids in [0, {vocab}).", param)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model",
                       code=404)


def _check_unsupported(req: _SamplingFields) -> None:
    """Refuse what would silently change the output distribution if ignored."""
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is only returned without streaming.", "prompt_logprobs")
    if req.model_extra:
        log.info("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))


def _sampling(state: ServerState, req: _SamplingFields, prompt_ids: list[int], max_tokens: int | None,
              logprobs: int | None, prompt_param: str, max_param: str = "max_tokens") -> Prepared:
    """Check lengths and sampling fields; unset max tokens means "up to the context length"."""
    engine = state.engine
    if not prompt_ids:
        raise bad_request("The prompt is empty.", prompt_param)
    limit = engine.max_context
    if max_tokens is None:
        max_tokens = limit - len(prompt_ids)
    if len(prompt_ids) >= limit or len(prompt_ids) + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce the length of the prompt or the completion.",
            max_param if len(prompt_ids) < limit else prompt_param)
    vocab = engine.vocab_size
    stop_ids = tuple(req.stop_token_ids or ())
    _check_token_ids(stop_ids, vocab, "stop_token_ids", "stop_token_ids")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        bias = tuple((int(key), value) for key, value in (req.logit_bias or {}).items())
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings).", "logit_bias") from None
    _check_token_ids([token for token, _ in bias], vocab, "logit_bias keys", "logit_bias")
    sent = {k: getattr(req, k) for k in NEUTRAL_SAMPLING if getattr(req, k) is not None}
    try:
        params = SamplingParams(
            **_merged_sampling(state.sampling_defaults, sent),
            max_new_tokens=max_tokens,
            seed=req.seed,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=bias,
            prompt_logprobs=req.prompt_logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return Prepared(prompt_ids, params, tuple(s for s in stop if s))


def _merged_sampling(defaults: dict[str, float], sent: dict[str, float]) -> dict[str, float]:
    """The sampling fields a request runs with: what it sent over the server's defaults, top_k -1 and 0 both
    meaning off."""
    merged = {**defaults, **sent}
    return {**merged, "top_k": max(0, merged["top_k"])}


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"Only text content parts are supported, got {part.type!r}.",
                              f"messages.{index}.content")
        texts.append(part.text)
    return "\n".join(texts)


def _chat_prompt_ids(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> tuple[list[int], bool]:
    """(the prompt ids of a chat, whether its tools were rendered into them): /tokenize renders with this
    too, so both agree, and so does `ddtree generate --chat`."""
    tools = _tools_rendered(state, req)
    # OpenAI's "developer" role is the system prompt under a new name; chat templates only know "system".
    messages = []
    for i, m in enumerate(req.messages):
        message = {"role": "system" if m.role == "developer" else m.role, "content": _message_text(m, i)}
        extra = {"tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id, "name": m.name}
        messages.append(template_message(message | {k: v for k, v in extra.items() if v is not None}))
    if state.engine.tokenizer is None:
        raise bad_request("This model has no tokenizer: use /v1/completions with token ids.", "messages")
    kwargs = _template_kwargs(state, req) | ({"tools": req.tools} if tools else {})
    try:
        ids = state.engine.chat_ids(messages, add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message, **kwargs)
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the client's
        raise bad_request(f"Could not apply the chat template: {exc}", "messages") from None
    return ids, tools


def _template_kwargs(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The chat template arguments a chat renders with: the server's defaults, the request's own keys winning."""
    return state.config.default_chat_template_kwargs | (req.chat_template_kwargs or {})


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> Prepared:
    _check_model(state, req.model)
    _check_unsupported(req)
    prompt_ids, tool_calls = _chat_prompt_ids(state, req)
    structure = _requested_grammar(req, _forced_call(req) if tool_calls else None)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prepared = _sampling(state, req, prompt_ids, max_tokens, logprobs, "messages", max_param)
    thinks = _parser_on(state, state.config.reasoning_parser, "qwen3", REASONING_CLOSE)
    prompt_block = _prompt_think_block(state, prompt_ids) if thinks else None
    think = None
    if thinks and structure is not None:
        think = _think_block(state, req, prompt_block)
        thinks = think is not None  # else the grammar applies from the first token: no room for a think block
    prepared.reply = ReplyFormat(reasoning=thinks, tool_calls=tool_calls,
                                 parallel_tool_calls=req.parallel_tool_calls,
                                 reasoning_opened=thinks and prompt_block == "open")
    return _constrained(state, prepared, structure, think)


def _parser_on(state: ServerState, setting: str, name: str, marker: str) -> bool:
    """Whether the reply parser `name` runs: set to it, or `auto` and the chat template writes `marker`."""
    if setting == "auto":
        return template_mentions(getattr(state.engine.tokenizer, "chat_template", None), marker)
    return setting == name


def _prompt_think_block(state: ServerState, prompt_ids: list[int]) -> str | None:
    """How the rendered prompt leaves a think block: "open" (templates that open it for the model),
    "closed" (an empty one, as Qwen3's template writes with enable_thinking false), or None."""
    tail = state.engine.decode(prompt_ids[-16:])
    opened, closed = tail.rfind(REASONING_OPEN), tail.rfind(REASONING_CLOSE)
    return None if opened == closed else "open" if opened > closed else "closed"


def _think_block(state: ServerState, req: ChatCompletionRequest, prompt_block: str | None) -> ThinkBlock | None:
    """The think block a constrained chat may write before its grammar applies, as vLLM's reasoning parser
    allows; None when the request does not think (enable_thinking false, or the prompt closed the block)
    or the tokenizer has no single <think> and </think> tokens to tell where the block ends."""
    if prompt_block == "closed" or _template_kwargs(state, req).get("enable_thinking") is False:
        return None
    tags = [state.engine.encode(tag) for tag in (REASONING_OPEN, REASONING_CLOSE)]
    if any(len(ids) != 1 for ids in tags):
        return None
    return ThinkBlock(tags[0][0], tags[1][0], opened=prompt_block == "open")


def _constrained(state: ServerState, prepared: Prepared, structure: str | None,
                 think: ThinkBlock | None = None) -> Prepared:
    if structure is not None:
        if state.engine.tokenizer is None:
            raise bad_request("Structured outputs need the model's tokenizer.", "response_format")
        prepared.params = dataclasses.replace(prepared.params, grammar=structure, think=think)
    return prepared


def _requested_grammar(req: _SamplingFields, forced_call: str | None = None) -> str | None:
    """The grammar a request decodes under, from whichever one structure it asks for: `response_format`
    (`json_object`: any JSON object; `json_schema`: its `json_schema.schema`), vLLM's `structured_outputs`
    (`json`, `regex` or `choice`) or `guided_json` / `guided_regex` / `guided_choice`, or a forced tool
    choice. None for free text."""
    asked: list[tuple[str, str, Any]] = []  # (param, kind, spec)
    response_format = req.response_format or {}
    kind = response_format.get("type", "text")
    if kind == "json_object":
        asked.append(("response_format", "json", grammar.JSON_OBJECT))
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        asked.append(("response_format", "json", spec.get("schema") if isinstance(spec, dict) else None))
    elif kind != "text":
        raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}.",
                          "response_format")
    for key, spec in (req.structured_outputs or {}).items():
        if key in ("json", "regex", "choice") and spec is not None:
            asked.append(("structured_outputs", key, spec))
        elif spec is not None and key not in ("disable_any_whitespace", "disable_additional_properties"):
            raise bad_request(f"structured_outputs.{key} is not supported (json, regex and choice are).",
                              "structured_outputs")
    for key in ("json", "regex", "choice"):
        if (spec := getattr(req, f"guided_{key}")) is not None:
            asked.append((f"guided_{key}", key, spec))
    if forced_call is not None:
        asked.append(("tool_choice", "grammar", forced_call))
    if len(asked) > 1:
        raise bad_request(f"Ask for one output structure at a time (got {', '.join(a[0] for a in asked)}).",
                          asked[1][0])
    if not asked:
        return None
    param, kind, spec = asked[0]
    try:
        if kind == "grammar":
            return spec
        if kind == "json":
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema object is needed" + (" (json_schema.schema)"
                                                                     if param == "response_format" else ""))
            return grammar.json_schema_grammar(schema)
        if kind == "regex":
            if not isinstance(spec, str):
                raise ValueError("the regex must be a string")
            return grammar.regex_grammar(spec)
        return grammar.choice_grammar(spec)
    except (ValueError, DDTreeError) as exc:  # json.JSONDecodeError is a ValueError
        raise bad_request(f"{param}: {exc}", param) from None


def _tools_rendered(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> bool:
    """Whether a chat renders its tools into the prompt (and parses calls from the reply): it offers some
    and tool_choice is not "none"; the refusals, with reasons."""
    choice = req.tool_choice
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if isinstance(choice, dict) and (choice.get("type") != "function" or not isinstance(named, str)):
        raise bad_request("A named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                          "tool_choice")
    if not isinstance(choice, dict) and choice not in (None, "auto", "none", "required"):
        raise bad_request(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, got {choice!r}.",
                          "tool_choice")
    if (choice == "required" or named is not None) and not req.tools:
        raise bad_request("tool_choice forces a call but the request offers no tools.", "tool_choice")
    if not req.tools or choice == "none":
        return False
    for i, tool in enumerate(req.tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("Each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}.",
                              f"tools.{i}")
    if not _parser_on(state, state.config.tool_call_parser, "hermes", TOOL_CALL_START):
        raise bad_request("This server does not parse tool calls for this model: its chat template does not "
                          "write Hermes <tool_call> blocks (start it with --tool-call-parser hermes if the model "
                          "does), or it runs with --tool-call-parser none.", "tools")
    if named is not None and named not in {t["function"]["name"] for t in req.tools}:
        raise bad_request(f"tool_choice names {named!r}, which is not among the tools.", "tool_choice")
    return True


def _forced_call(req: ChatCompletionRequest) -> str | None:
    """The grammar a forced tool_choice (`required`, or a named function) decodes under; None for `auto`."""
    named = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
    if req.tool_choice != "required" and named is None:
        return None
    try:
        return grammar.lark_grammar(forced_call_grammar(req.tools, named, req.parallel_tool_calls))
    except (ValueError, DDTreeError) as exc:
        raise bad_request(f"The tools' parameters cannot constrain decoding: {exc}", "tools") from None


def prepare_completion(state: ServerState, req: CompletionRequest) -> Prepared:
    _check_model(state, req.model)
    _check_unsupported(req)
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    if req.best_of not in (None, 1):
        raise bad_request("best_of must be 1.", "best_of")
    if req.echo and req.logprobs is not None and req.stream:
        raise bad_request("echo with logprobs (the prompt's log-probabilities) is only returned without "
                          "streaming.", "echo")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("Send one prompt per request (batched prompts are not supported).", "prompt")
        prompt = prompt[0]
    engine = state.engine
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise bad_request("This model has no tokenizer: send the prompt as token ids.", "prompt")
        prompt_ids, prompt_text = engine.encode(prompt), prompt
    else:
        _check_token_ids(prompt, engine.vocab_size, "Prompt token ids", "prompt")
        prompt_ids, prompt_text = list(prompt), engine.decode(list(prompt))
    structure = _requested_grammar(req)
    prepared = _sampling(state, req, prompt_ids, req.max_tokens, req.logprobs, "prompt")
    prepared.prompt_text = prompt_text
    if req.echo and req.logprobs is not None:  # the echoed prompt comes with its own log-probabilities
        k = max(req.logprobs, req.prompt_logprobs or 0)
        prepared.params = dataclasses.replace(prepared.params, prompt_logprobs=k)
    return _constrained(state, prepared, structure)


# --------------------------------------------------------------------------------------------------------
# Responses


def _usage(requests: list[EngineRequest]) -> dict:
    """The prompt counts once; the completions of all n choices add up (as OpenAI counts them)."""
    prompt = len(requests[0].prompt_ids)
    completion = sum(r.completion_tokens for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class _LogprobFormatter:
    """Engine TokenLogprobs -> OpenAI's chat or legacy completions shapes."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.token_text = lru_cache(maxsize=65536)(lambda token_id: decode([token_id]))

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, logprobs: list) -> list[dict]:
        return [{**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                for lp in logprobs]

    def legacy_prompt(self, prompt_ids: list[int], logprobs: list) -> dict:
        """Completions logprobs of an echoed prompt (the first token has none, as in OpenAI's)."""
        tokens = [self.token_text(t) for t in prompt_ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [None if lp is None else self._legacy_top(lp) for lp in logprobs],
                "text_offset": offsets}

    def vllm_prompt(self, logprobs: list) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for the token
        and its top alternatives (None for the first)."""
        return [None if lp is None else {
            str(t): {"logprob": _finite(v), "rank": rank, "decoded_token": self.token_text(t)}
            for t, v, rank in [(lp.token_id, lp.logprob, lp.rank),
                               *((t, v, i + 1) for i, (t, v) in enumerate(lp.top))]} for lp in logprobs]

    def _legacy_top(self, lp) -> dict:
        top = {self.token_text(t): _finite(v) for t, v in lp.top}
        return top or {self.token_text(lp.token_id): _finite(lp.logprob)}

    def legacy(self, logprobs: list, offset: int) -> dict:
        """Completions logprobs; `offset` is where this piece starts in the returned text."""
        tokens, offsets = [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [self._legacy_top(lp) for lp in logprobs], "text_offset": offsets}


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class _Call:
    """One API call in flight: its engine requests (one per choice) plus what its response needs."""

    kind: Literal["chat", "completion"]
    requests: list[EngineRequest]
    body: ChatCompletionRequest | CompletionRequest
    prepared: Prepared
    model: str
    logprobs: _LogprobFormatter
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        return f"chatcmpl-{self.id}" if self.kind == "chat" else f"cmpl-{self.id}"

    def extras(self, top: dict) -> dict:
        """vLLM's `return_token_ids` and the opt-in per-request speculative stats (single-choice calls only:
        n sequences have n sets, which vLLM reports as none either)."""
        if self.body.return_token_ids:
            top["prompt_token_ids"] = self.requests[0].prompt_ids
        spec = self.requests[0].spec if len(self.requests) == 1 else None
        if self.body.return_spec_stats and spec is not None:
            top["metrics"] = {"speculative_decoding": spec.to_dict()}
        return top


async def _outputs(scheduler: Scheduler, http: Request,
                   requests: list[EngineRequest]) -> AsyncIterator[tuple[int, Output]]:
    """(choice index, output) from every request as they come, until each has its final one; a client that
    disconnects cancels the engine work of all of them."""
    merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()

    async def forward(index: int, request: EngineRequest) -> None:
        while True:
            output = await request.outputs.get()
            await merged.put((index, output))
            if output.finish_reason is not None:
                return

    async def watch_disconnect() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for request in requests:
            scheduler.cancel(request)

    tasks = [asyncio.create_task(forward(i, r)) for i, r in enumerate(requests)]
    watcher = asyncio.create_task(watch_disconnect())
    try:
        for _ in requests:  # until every choice has its final output
            while True:
                index, output = await merged.get()
                yield index, output
                if output.finish_reason is not None:
                    break
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        for request in requests:
            scheduler.cancel(request)


async def _complete(call: _Call, outputs: AsyncIterator[tuple[int, Output]]) -> Response:
    n = len(call.requests)
    text: list[list[str]] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    final: list[Output | None] = [None] * n
    async for index, out in outputs:
        text[index].append(out.text)
        token_ids[index].extend(out.token_ids)
        logprobs[index].extend(out.logprobs or ())
        if out.finish_reason is not None:
            final[index] = out
    for out in final:
        if out.finish_reason == "abort":
            if out.error:
                return APIError(500, f"The engine failed: {out.error}", type="internal_error").response()
            return Response(status_code=499)  # the client is gone; nobody reads this
    want_logprobs = call.prepared.params.logprobs is not None
    choices = []
    for index, out in enumerate(final):
        content = "".join(text[index])
        reason = out.finish_reason
        if call.kind == "chat":
            message = {"role": "assistant", **call.prepared.reply.message(content)}
            reason = finish_reason(reason, message.get("tool_calls"))
            choice = {"index": index, "message": message,
                      "logprobs": {"content": call.logprobs.chat(logprobs[index])} if want_logprobs else None}
        else:
            prefix = call.prepared.prompt_text if call.body.echo else ""
            choice = {"index": index, "text": prefix + content,
                      "logprobs": call.logprobs.legacy(logprobs[index], len(prefix)) if want_logprobs else None}
            if want_logprobs and call.body.echo:  # the prompt's entries first, as OpenAI's echo gives them
                request = call.requests[index]
                echoed = call.logprobs.legacy_prompt(request.prompt_ids, request.prompt_logprobs)
                choice["logprobs"] = {key: echoed[key] + choice["logprobs"][key] for key in echoed}
        if call.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = call.logprobs.vllm_prompt(call.requests[index].prompt_logprobs)
        choice.update(finish_reason=reason, stop_reason=out.stop_reason)
        if call.body.return_token_ids:
            choice["token_ids"] = token_ids[index]
        choices.append(choice)
    body = {"id": call.object_id, "object": "chat.completion" if call.kind == "chat" else "text_completion",
            "created": call.created, "model": call.model, "choices": choices, "usage": _usage(call.requests),
            "system_fingerprint": f"ddtree-{__version__}"}
    return JSONResponse(call.extras(body))


async def _stream(call: _Call, outputs: AsyncIterator[tuple[int, Output]]) -> AsyncIterator[str]:
    """SSE: per choice an opening chunk, one chunk per engine round and a finish chunk (choices interleave,
    told apart by `index`), then an optional usage chunk, then [DONE]."""
    chat = call.kind == "chat"
    include_usage = bool(call.body.stream_options and call.body.stream_options.include_usage)
    want_logprobs = call.prepared.params.logprobs is not None
    offsets = [0] * len(call.requests)
    replies = [ReplyStream(call.prepared.reply) for _ in call.requests] if chat else []

    def chunk_body(choices: list[dict], **extra: Any) -> str:
        body = {"id": call.object_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": call.created, "model": call.model, "choices": choices, **extra}
        if include_usage:
            body.setdefault("usage", None)
        return _sse(body)

    def chunk(choice: dict, **extra: Any) -> str:
        return chunk_body([choice], **extra)

    for index in range(len(call.requests)):
        if chat:
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        elif call.body.echo:
            offsets[index] = len(call.prepared.prompt_text)
            yield chunk({"index": index, "text": call.prepared.prompt_text, "logprobs": None,
                         "finish_reason": None})
    async for index, out in outputs:
        if out.finish_reason == "abort":
            if out.error:
                yield _sse(APIError(500, f"The engine failed: {out.error}", type="internal_error").body())
                yield _sse("[DONE]")
            return
        if chat:
            choices = [{"delta": delta, "logprobs": None} for delta in replies[index].feed(out.text)]
            logprobs = {"content": call.logprobs.chat(out.logprobs)} if want_logprobs else None
        else:
            choices = [{"text": out.text, "logprobs": None}] if out.text else []
            logprobs = call.logprobs.legacy(out.logprobs, offsets[index]) if want_logprobs else None
            offsets[index] += len(out.text)
        if not choices and out.token_ids and (want_logprobs or call.body.return_token_ids):
            choices = [{"delta": {}} if chat else {"text": ""}]
        if choices:  # a round's log-probs and token ids go with its first chunk
            choices[0]["logprobs"] = logprobs
            if call.body.return_token_ids:
                choices[0]["token_ids"] = out.token_ids
        for choice in choices:
            yield chunk({"index": index, **choice, "finish_reason": None})
        if out.finish_reason is not None:
            calls: list[dict[str, Any]] = []
            if chat:  # what was held back: the last text, the rest of the calls
                deltas, calls = replies[index].finish()
                for delta in deltas:
                    yield chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
            final = {"index": index, "delta": {}} if chat else {"index": index, "text": ""}
            yield chunk({**final, "logprobs": None, "finish_reason": finish_reason(out.finish_reason, calls),
                         "stop_reason": out.stop_reason}, **call.extras({}))
    if include_usage:
        yield chunk_body([], usage=_usage(call.requests))
    yield _sse("[DONE]")


# --------------------------------------------------------------------------------------------------------
# The app


class _ApiKeyMiddleware:
    """Bearer-token check on /v1 and the tokenizer utilities (plain ASGI, so streaming and disconnects pass
    through untouched); probes, /metrics and /version stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/tokenize", "/detokenize")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(load_engine: Callable[[], Any], config: ServerConfig | None = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The ASGI app. The engine loads in a thread at startup: /health answers at once, /ready when loaded."""
    state = ServerState(config or ServerConfig())

    def load() -> None:
        try:
            state.load(load_engine)
        except BaseException as exc:
            state.load_error = str(exc)
            log.error("could not load the model: %s", exc)
            if on_load_error is not None:
                on_load_error(exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load, name="ddtree-load", daemon=True).start()
        yield
        state.draining = True
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.shutdown, state.config.drain_timeout)

    app = FastAPI(title="ddtree", version=__version__, lifespan=lifespan)
    app.state.ddtree = state
    if state.config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=state.config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, code=exc.status_code).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"Internal server error: {exc}", type="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process is up (the model may still be loading)."""
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the model is loaded and the server is not draining."""
        state.require_ready()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(503, "The model is still loading.", type="service_unavailable")
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        state.require_ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "ddtree", "max_model_len": state.engine.max_context}]}

    async def serve(http: Request, kind: Literal["chat", "completion"], body, prepared: Prepared) -> Response:
        scheduler = state.require_ready()
        requests = [EngineRequest(prepared.prompt_ids, choice_params(prepared.params, i), stop=prepared.stop,
                                  include_stop_str=body.include_stop_str_in_output,
                                  client=body.user or (http.client.host if http.client else ""))
                    for i in range(body.n)]
        try:
            for request in requests:
                scheduler.submit(request)
        except (QueueFull, Draining) as exc:
            for request in requests:  # all n choices or none
                scheduler.cancel(request)
            if isinstance(exc, Draining):
                raise APIError(503, "The server is shutting down.", type="service_unavailable") from None
            raise APIError(429, "The server is at capacity; retry later.", type="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        call = _Call(kind, requests, body, prepared, state.model_name, _LogprobFormatter(state.engine.decode))
        outputs = _outputs(scheduler, http, requests)
        if body.stream:
            return StreamingResponse(_stream(call, outputs), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(call, outputs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        state.require_ready()
        return await serve(http, "chat", body, prepare_chat(state, body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        state.require_ready()
        return await serve(http, "completion", body, prepare_completion(state, body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """The prompt ids /v1/completions (prompt) or /v1/chat/completions (messages) would decode from."""
        state.require_ready()
        _check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Send exactly one of prompt and messages.", "prompt")
        if body.messages is not None:
            ids = _chat_prompt_ids(state, body)[0]
        elif state.engine.tokenizer is None:
            raise bad_request("This model has no tokenizer.", "prompt")
        else:
            ids = state.engine.encode(body.prompt)
        return {"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.require_ready()
        _check_model(state, body.model)
        _check_token_ids(body.tokens, state.engine.vocab_size, "tokens", "tokens")
        return {"prompt": state.engine.decode(body.tokens)}

    return app
