"""Running a prepared request: its choices through the scheduler, and the reply, whole or streamed as
Server-Sent Events: text, reasoning and tool-call deltas, logprobs in OpenAI's (and vLLM's) shapes, usage, and
speculative-decoding statistics on request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ddtree import __version__
from ddtree.api.metrics import ServerMetrics
from ddtree.api.prepare import Prepared
from ddtree.api.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ddtree.api.replies import ReplyStream, finish_reason
from ddtree.api.scheduler import Output, Scheduler
from ddtree.api.scheduler import Request as EngineRequest

# JSON has no -inf; vLLM reports filtered-out alternatives with this value.
MIN_LOGPROB = -9999.0




# --------------------------------------------------------------------------------------------------------
# Responses


def _usage(requests: list[EngineRequest]) -> dict:
    """The prompt counts once; the completions of all n choices add up (as OpenAI counts them); cached tokens are
    the first choice's prompt tokens found in the prefix cache."""
    prompt = len(requests[0].prompt_ids)
    completion = sum(r.completion_tokens for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": requests[0].cached_tokens}}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class LogprobFormatter:
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
class Call:
    """One API call in flight: its engine requests (one per choice) plus what its response needs."""

    kind: Literal["chat", "completion"]
    requests: list[EngineRequest]
    body: ChatCompletionRequest | CompletionRequest
    prepared: Prepared
    model: str
    logprobs: LogprobFormatter
    metrics: ServerMetrics
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


async def choice_outputs(scheduler: Scheduler, http: Request,
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

    watcher = asyncio.create_task(watch_disconnect())
    if len(requests) == 1:  # one choice (nearly every call): its outputs as they come, with no queue between
        try:
            while True:
                output = await requests[0].outputs.get()
                yield 0, output
                if output.finish_reason is not None:
                    return
        finally:
            watcher.cancel()
            scheduler.cancel(requests[0])
    tasks = [asyncio.create_task(forward(i, r)) for i, r in enumerate(requests)]
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


def _ended_early(out: Output) -> APIError:
    """Why a request ended without finishing: the server shut down (503, worth a retry elsewhere) or the
    engine failed (500)."""
    if out.retryable:
        return APIError(503, out.error, type="service_unavailable")
    return APIError(500, f"The engine failed: {out.error}", type="internal_error")


async def complete_reply(call: Call, outputs: AsyncIterator[tuple[int, Output]]) -> Response:
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
                return _ended_early(out).response()
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
    call.metrics.generation_tokens.inc(sum(len(ids) for ids in token_ids))  # returned now, and only now
    return JSONResponse(call.extras(body))


async def stream_reply(call: Call, outputs: AsyncIterator[tuple[int, Output]]) -> AsyncIterator[str]:
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
                yield _sse(_ended_early(out).body())
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
        # Counted once its chunks were sent: a client gone before that (the response task is cancelled at its
        # disconnect) never received them.
        call.metrics.generation_tokens.inc(len(out.token_ids))
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


