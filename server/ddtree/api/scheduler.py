"""Request scheduling: a bounded fair queue in front of the batch engine, run by one worker thread (or, over an
engine process, by the event loop itself: api/loop_scheduler.py).

An engine in this process is synchronous, so it runs in a worker thread and the event loop only moves bytes.
Requests wait in a `FairQueue` (round-robin across clients, bounded: a full queue is refused with 429 rather than
growing without limit). The worker moves requests into the batch engine (engine/batch.py) while it has room for
them (--max-num-seqs), and each engine step advances every running request by one round: their outputs
are posted back to the waiting coroutines as they come. A request whose client goes away is aborted in the
engine before the next step, which frees its KV blocks at once.

Text handling lives here too, in the worker: each round's tokens are detokenized and cut at stop strings
(text that may be the start of a stop string is withheld until resolved), so `usage` only ever sees tokens a
client can receive. Whether it did receive them is known only where the reply is written: serving.py counts
`vllm:generation_tokens` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ddtree.api.metrics import ServerMetrics
from ddtree.core.sampling import SamplingParams

log = logging.getLogger("ddtree.server")

IDLE_GAUGES_S = 0.25  # how often an idle worker refreshes the gauges (an engine process reports after its aborts)


class QueueFull(Exception):
    """The waiting queue is at capacity; the client should retry later."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("the server is at capacity; retry later")
        self.retry_after = retry_after


class Draining(Exception):
    """The server is shutting down and takes no new work."""


# --------------------------------------------------------------------------------------------------------
# Text: incremental detokenization and stop strings


class StopStringDetokenizer:
    """Turns generated token ids into text one token at a time and finds stop strings.

    Decoding a sliding window (`prefix`..end minus `prefix`..`read`) keeps per-token cost constant and
    gets leading spaces right for tokenizers that strip them at the start of a decode; a token that ends
    inside a multi-byte character (decodes to U+FFFD) is held until the character completes.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 include_stop: bool = False) -> None:
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.matched: str | None = None
        self._prefix = 0
        self._read = 0
        self._released = 0

    def add(self, token_id: int) -> bool:
        """Append one token; True when it completes a stop string (the text is then cut before it)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def add_round(self, token_ids: Sequence[int]) -> int:
        """Append a round's tokens with one decode for the round, not one per token; returns how many to keep:
        all, or up to and including the one that completes a stop string. Where the round's text holds a stop
        string or ends inside a character, it goes again one token at a time, so the cut and the text held
        back are exactly `add`'s."""
        if len(token_ids) > 1:
            ids, text, prefix, read = len(self.ids), self.text, self._prefix, self._read
            self.ids.extend(token_ids)
            if not self._advance(final=False) and self._read == len(self.ids):
                return len(token_ids)
            del self.ids[ids:]
            self.text, self._prefix, self._read, self.matched = text, prefix, read, None
        for kept, token_id in enumerate(token_ids, 1):
            if self.add(token_id):
                return kept
        return len(token_ids)

    def flush(self) -> None:
        """Decode whatever is still pending at the end of the generation, even a broken character."""
        if self.matched is None and self._read < len(self.ids):
            self._advance(final=True)

    def release(self, final: bool = False) -> str:
        """Text that is now safe to send: everything except a suffix that could start a stop string."""
        end = len(self.text)
        if not final and self.matched is None:
            end -= self._held_back()
        out = self.text[self._released:end]
        self._released = max(self._released, end)
        return out

    def _advance(self, final: bool) -> bool:
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return False
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += piece
        return self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> bool:
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.matched = stop
        self.text = self.text[:index + len(stop) if self._include_stop else index]
        return True

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        for k in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


# --------------------------------------------------------------------------------------------------------
# Requests and what flows back to the HTTP side


@dataclass
class SpecStats:
    """Per-request speculative-decoding accounting, from the rounds this request ran."""

    method: str
    budget: int | None
    block_size: int
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_length_counts: list[int] = field(default_factory=list)  # [k-1] = rounds that committed k tokens

    def add_round(self, draft_nodes: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += draft_nodes
        self.accepted_tokens += accepted
        length = accepted + 1
        if len(self.accepted_length_counts) < length:
            self.accepted_length_counts.extend([0] * (length - len(self.accepted_length_counts)))
        self.accepted_length_counts[length - 1] += 1

    def to_dict(self) -> dict:
        """The `metrics.speculative_decoding` response object (τ = 1 + accepted / rounds)."""
        tau = 1.0 + self.accepted_tokens / self.rounds if self.rounds else None
        return {"method": self.method, "budget": self.budget, "block_size": self.block_size,
                "num_verify_rounds": self.rounds, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens, "acceptance_length": tau,
                "accepted_length_histogram": self.accepted_length_counts}


@dataclass
class Output:
    """What one engine round produced for a client, after stop handling (possibly no text yet)."""

    text: str
    token_ids: list[int]
    logprobs: list | None  # engine TokenLogprob per token in token_ids, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" (abort is never shown to clients)
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    error: str | None = None  # the engine failed, or the server shut down; the request is over
    retryable: bool = False  # the server shut down before it finished (a 503: another replica can serve it)


@dataclass
class Request:
    """One sequence to decode. Created on the event loop; outputs are posted back to it thread-safely."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    cache_salt: str | None = None  # only requests with the same salt share cached prompt prefixes
    client: str = ""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (usage.prompt_tokens_details)
    prompt_logprobs: list | None = None  # the engine's TokenLogprob per prompt token (first: None), if asked
    spec: SpecStats | None = None
    finish_reason: str | None = None
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def mark_cancelled(self) -> None:
        """The worker stops this request before its next round (thread-safe)."""
        self._cancelled.set()

    def post(self, output: Output) -> None:
        """Hand an output to the waiting coroutine (safe from any thread, even after the loop closed)."""
        Request.post_all(((self, output),))

    @staticmethod
    def post_all(posts: Sequence[tuple[Request, Output]]) -> None:
        """`post` for a whole step's outputs at once: one wake-up of each event loop, not one per request (none
        when the step was taken on the requests' own loop: their queues take the outputs at once)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Output], Output]]] = {}
        for request, output in posts:
            by_loop.setdefault(request._loop, []).append((request.outputs, output))
        here = _running_loop()
        for loop, items in by_loop.items():
            if loop is here:
                _put_all(items)
                continue
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _put_all(items: list[tuple[asyncio.Queue[Output], Output]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


# --------------------------------------------------------------------------------------------------------
# The fair queue


class FairQueue:
    """Bounded waiting room served round-robin across clients, FIFO within a client.

    One client's burst of requests cannot starve another client: each client has a lane, and lanes take
    turns. Thread-safe; `get` blocks until a request arrives or `close` is called.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("queue capacity must be at least 1")
        self.capacity = capacity
        self._lanes: OrderedDict[str, deque[Request]] = OrderedDict()
        self._size = 0
        self._closed = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return self._size

    def put(self, request: Request) -> bool:
        """Enqueue; False (and nothing enqueued) when full."""
        with self._cond:
            if self._size >= self.capacity:
                return False
            self._lanes.setdefault(request.client, deque()).append(request)
            self._size += 1
            self._cond.notify()
            return True

    def get(self, block: bool = True, timeout: float | None = None) -> Request | None:
        """Next request in round-robin order; None when closed (or empty and not blocking, or after `timeout`)."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._lanes or self._closed, timeout)
            if not self._lanes:
                return None
            client, lane = next(iter(self._lanes.items()))
            request = lane.popleft()
            if lane:
                self._lanes.move_to_end(client)
            else:
                del self._lanes[client]
            self._size -= 1
            return request

    def remove(self, request: Request) -> bool:
        """Take a waiting request out (its client went away); False when it is not waiting."""
        with self._cond:
            lane = self._lanes.get(request.client)
            if lane is None or request not in lane:
                return False
            lane.remove(request)
            if not lane:
                del self._lanes[request.client]
            self._size -= 1
            return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wake every blocked `get` so the worker can exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# --------------------------------------------------------------------------------------------------------
# The scheduler


@dataclass
class _Running:
    request: Request
    sequence: object  # the batch engine's handle (ddtree.engine.sequence.Sequence)
    text: StopStringDetokenizer


class Scheduler:
    """Owns the batch engine: admits requests from the fair queue and steps it in one worker thread."""

    def __init__(self, batch, decode: Callable[[list[int]], str], metrics: ServerMetrics, *, max_queue: int,
                 eos_token_ids: set[int], spec: Callable[[], SpecStats]) -> None:
        """`batch`: a BatchEngine (or a test double with its interface); `spec` makes a request's speculative
        statistics record (its method, budget and block size)."""
        self.batch = batch
        self.decode = decode
        self.metrics = metrics
        self.queue = FairQueue(max_queue)
        self.eos_token_ids = eos_token_ids
        self.spec = spec
        self.draining = False
        self._aborting: str | None = None  # set by abort_all: every request ends with this error
        self._running: dict[object, _Running] = {}  # touched by the worker thread only
        self._posts: list[tuple[Request, Output]] = []  # a step's outputs, posted together at its end
        self._mean_seconds = 1.0  # moving average of request service time, for Retry-After
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
        self._thread.start()

    @property
    def max_running(self) -> int:
        return self.batch.max_num_seqs

    # -- event-loop side ---------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; raises Draining or QueueFull (nothing queued then)."""
        if self.draining:
            self.metrics.rejected("draining")
            raise Draining("the server is shutting down")
        if not self.queue.put(request):
            self.metrics.rejected("queue_full")
            raise QueueFull(self.retry_after())
        self.metrics.waiting.set(len(self.queue))

    def cancel(self, request: Request) -> None:
        """The client went away: drop the request if waiting, or stop it at its next round."""
        if request.finish_reason is not None:
            return
        request.mark_cancelled()
        if self.queue.remove(request):
            self.metrics.waiting.set(len(self.queue))
            self._abort(request)

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely to free up."""
        return max(1, math.ceil(self._mean_seconds * (len(self.queue) + 1) / self.max_running))

    def abort_all(self, reason: str) -> None:
        """The drain ran out of time: refuse new work and end every request with `reason` (a 503), those
        waiting now and the running ones before their next round."""
        self.draining = True
        self._aborting = reason
        while (request := self.queue.get(block=False)) is not None:
            self.metrics.waiting.set(len(self.queue))
            self._abort(request, reason, retryable=True)

    def idle(self) -> bool:
        return not self._running and not len(self.queue)

    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new work, let queued and running requests finish, then stop the worker."""
        self.draining = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.idle() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)
        self._stop()

    def _stop(self) -> None:
        self.queue.close()
        self._thread.join(timeout=5)

    # -- worker thread -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._admit()
            if self._running:
                self._step()
            elif self.queue.closed:
                return

    def _admit(self) -> None:
        """Move waiting requests into the batch engine while it has room (blocks for one when nothing runs)."""
        while len(self._running) < self.max_running:
            request = self._next_waiting()
            if request is None:
                if not self._running:  # idle: the engine's last aborts may have freed blocks since
                    self._gauges()
                return
            self.metrics.waiting.set(len(self.queue))
            if request.cancelled or self._aborting:
                self._abort(request, self._aborting, retryable=self._aborting is not None)
                continue
            request.scheduled = time.monotonic()
            self.metrics.queue_time.observe(request.scheduled - request.arrival)
            try:
                sequence = self.batch.add(request.prompt_ids, request.params, cache_salt=request.cache_salt)
            except Exception as exc:  # a bad request the validation missed must not kill the worker
                log.exception("could not start request %s", request.request_id)
                self._abort(request, str(exc))
                continue
            request.spec = self.spec()
            text = StopStringDetokenizer(self.decode, request.stop, request.include_stop_str)
            self._running[sequence] = _Running(request, sequence, text)
        self._gauges()

    def _next_waiting(self) -> Request | None:
        """The next request to admit; when nothing runs, waits for one (a while: the gauges refresh when idle)."""
        return self.queue.get(block=not self._running, timeout=IDLE_GAUGES_S)

    def _step(self) -> None:
        """One engine step: every running request's next round, its outputs posted together at the end."""
        try:
            self._run_step()
        finally:
            Request.post_all(self._posts)
            self._posts.clear()

    def _run_step(self) -> None:
        """A cancelled request is aborted first (its blocks freed); a request whose round failed ends with the
        error, the others go on."""
        for run in list(self._running.values()):
            if run.request.cancelled or self._aborting:
                self.batch.abort(run.sequence)
                self._retire(run, Output("", [], None, finish_reason="abort", error=self._aborting,
                                         retryable=self._aborting is not None))
        if not self._running:
            return
        try:
            outputs = self.batch.step()
        except Exception as exc:  # the engine itself failed: every running request ends with the error
            log.exception("engine step failed")
            for run in list(self._running.values()):
                self.batch.abort(run.sequence)
                self._retire(run, Output("", [], None, finish_reason="abort", error=str(exc)))
            return
        self.metrics.observe_step(self.batch.last)
        for sequence, out in outputs:
            run = self._running.get(sequence)
            if run is None:
                continue
            if isinstance(out, Exception):
                log.error("engine failed on request %s: %s", run.request.request_id, out)
                self._retire(run, Output("", [], None, finish_reason="abort", error=str(out)))
                continue
            final = self._deliver(run, out)
            if final is not None:
                self.batch.abort(run.sequence)  # a no-op unless a stop string the engine did not see ended it
                self._retire(run, final)
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.running.set(len(self._running))
        self.metrics.waiting.set(len(self.queue) + self.batch.waiting)
        self.metrics.kv_cache_usage.set(self.batch.kv_usage)

    def _deliver(self, run: _Running, out) -> Output | None:
        """One round's output for one request: posts it, or returns the final one when the request is over."""
        request = run.request
        now = time.monotonic()
        if out.is_prefill:
            request.prompt_logprobs = out.prompt_logprobs
            request.cached_tokens = run.sequence.cached_prompt
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))
            self.metrics.prefill_time.observe(now - request.scheduled)
            self.metrics.ttft.observe(now - request.arrival)
            request.first_token = now
        else:
            self.metrics.observe_round(draft_nodes=out.draft_nodes, accepted=out.accepted)
            request.spec.add_round(out.draft_nodes, out.accepted)
        kept = run.text.add_round(out.token_ids)  # the round, cut at the first completed stop string
        tokens = list(out.token_ids[:kept])
        logprobs = out.logprobs[:kept] if out.logprobs is not None else None
        if tokens:
            previous = request.last_token or request.first_token
            if not out.is_prefill and previous is not None:
                interval = now - previous
                self.metrics.itl.observe(interval)
                for _ in tokens:
                    self.metrics.token_itl.observe(interval / len(tokens))
            request.last_token = now
        if run.text.matched is not None:
            return self._output(run, tokens, logprobs, "stop", run.text.matched)
        if out.finish_reason is not None:
            stop_reason = out.stop_token_id if out.stop_token_id not in self.eos_token_ids else None
            return self._output(run, tokens, logprobs, out.finish_reason, stop_reason)
        self._posts.append((request, self._output(run, tokens, logprobs, None, None)))
        return None

    def _output(self, run: _Running, tokens: list[int], logprobs: list | None, finish_reason: str | None,
                stop_reason: str | int | None) -> Output:
        """Count the tokens of the request's reply and release the text that is safe to send."""
        run.request.completion_tokens += len(tokens)
        if finish_reason is not None:
            run.text.flush()
        return Output(run.text.release(final=finish_reason is not None), tokens, logprobs, finish_reason,
                      stop_reason)

    def _retire(self, run: _Running, final: Output) -> None:
        """Record the metrics before the client hears the request is over (the engine has freed its state): the
        gauges too, since a step that only aborted (the last clients went away) ends before it refreshes them."""
        self._running.pop(run.sequence, None)
        self._gauges()
        self._finish(run.request, final.finish_reason)
        self._posts.append((run.request, final))

    def _abort(self, request: Request, error: str | None = None, retryable: bool = False) -> None:
        """End a request that holds no engine state (it never started)."""
        self._finish(request, "abort")
        request.post(Output("", [], None, finish_reason="abort", error=error, retryable=retryable))

    def _finish(self, request: Request, reason: str) -> None:
        """Record a request's end-of-life metrics (once)."""
        if request.finish_reason is not None:
            return
        request.finish_reason = reason
        self.metrics.finished(reason)
        now = time.monotonic()
        self.metrics.e2e.observe(now - request.arrival)
        if request.scheduled is None:
            return
        self.metrics.request_prompt_tokens.observe(len(request.prompt_ids))
        self.metrics.request_generation_tokens.observe(request.completion_tokens)
        self.metrics.inference_time.observe(now - request.scheduled)
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (now - request.scheduled)
        if request.first_token is not None and request.last_token is not None:
            decode = request.last_token - request.first_token
            self.metrics.decode_time.observe(decode)
            if request.completion_tokens > 1:
                self.metrics.tpot.observe(decode / (request.completion_tokens - 1))
                if decode > 0:
                    self.metrics.tokens_per_second.observe((request.completion_tokens - 1) / decode)
