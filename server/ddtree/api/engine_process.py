"""The engine in a process of its own: the models, the batch engine and its steps there; the HTTP front end,
detokenization, stop strings and streaming in the server's process.

Why: one interpreter lock. In one process the event loop (encoding and writing every request's chunk), the
worker's detokenization and the engine's own host work (launches, trees, commits) take turns on the lock, so a
served step costs all three in a row, several times the engine's own step at 64 requests (benchmarks/RESULTS.md).
With the engine apart, it steps back to back while the front end turns step k's tokens
into text and chunks during step k+1 (vLLM's engine core and SGLang's scheduler process do the same).

The engine process steps whenever it has requests and sends one message a step: every request's round output,
the step's statistics and the batch's gauges. The front end's scheduler (api/scheduler.py) drives a
`RemoteBatch`, which has the batch engine's interface: `add` and `abort` send a message and return at once,
`step` waits for the next step's message. A request the front end ends (a stop string, a client gone) may have
run one more round in the engine before the abort arrives; its output is dropped here.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ddtree.api.config import ServerConfig
from ddtree.api.engine_setup import set_up
from ddtree.engine.batch import StepStats
from ddtree.engine.text import TextCodec
from ddtree.errors import DDTreeError

log = logging.getLogger("ddtree.server")


class EngineFailed(DDTreeError):
    """The engine process failed a step, or is gone."""


@dataclass
class EngineView(TextCodec):
    """What the front end reads of the engine: its names, limits, sampling defaults and tokenizer; no models."""

    tokenizer: Any
    model_name: str
    method: str
    budget: int
    block_size: int
    max_context: int
    vocab_size: int
    eos_token_ids: set[int]
    generation_defaults: dict[str, float]

    @classmethod
    def of(cls, engine: Any) -> EngineView:
        return cls(engine.tokenizer, engine.model_name, engine.method, engine.budget, engine.block_size,
                   engine.max_context, engine.vocab_size, set(engine.eos_token_ids), dict(engine.generation_defaults))


class RemoteSequence:
    """The front end's handle of a request decoding in the engine process."""

    __slots__ = ("cached_prompt", "id")

    def __init__(self, seq_id: int) -> None:
        self.id, self.cached_prompt = seq_id, 0


class RemoteBatch:
    """The batch engine's interface over the engine process (used from the scheduler's worker thread only)."""

    def __init__(self, conn: Connection, process: multiprocessing.process.BaseProcess, max_num_seqs: int) -> None:
        self.conn, self.process, self.max_num_seqs = conn, process, max_num_seqs
        self.last = StepStats()
        self._waiting, self._kv_usage = 0, 0.0
        self._ids = itertools.count()
        self._live: dict[int, RemoteSequence] = {}
        self._inbox: deque[tuple] = deque()  # step messages read ahead while reading the gauges
        self.gone = False  # the engine process closed its end: nothing more will come

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def waiting(self) -> int:
        self._read_ahead()
        return self._waiting

    @property
    def kv_usage(self) -> float:
        self._read_ahead()
        return self._kv_usage

    def add(self, prompt_ids: list[int], params: Any, cache_salt: str | None = None) -> RemoteSequence:
        seq = RemoteSequence(next(self._ids))
        self._send(("add", seq.id, list(prompt_ids), params, cache_salt))
        self._live[seq.id] = seq
        return seq

    def abort(self, seq: RemoteSequence) -> None:
        """Free the request in the engine; nothing to free when the engine process is gone."""
        if self._live.pop(seq.id, None) is not None:
            with contextlib.suppress(EngineFailed):
                self._send(("abort", seq.id))

    def step(self) -> list[tuple[RemoteSequence, Any]]:
        """The outputs of the engine's next step, for the requests still live here."""
        try:
            while not self._inbox:
                if self.gone:
                    raise EOFError
                self._take(self.conn.recv())
        except (EOFError, OSError):
            self.gone = True
            raise EngineFailed(self._gone()) from None
        message = self._inbox.popleft()
        if message[0] == "failed":
            raise EngineFailed(f"the engine step failed: {message[1]}")
        outputs = []
        for seq_id, result, cached_prompt in message[1]:
            seq = self._live.get(seq_id)
            if seq is None:  # aborted here after the engine ran its round
                continue
            if isinstance(result, str):  # the engine failed this request only
                result = EngineFailed(result)
            if isinstance(result, Exception) or result.finish_reason is not None:
                del self._live[seq_id]
            if cached_prompt is not None:
                seq.cached_prompt = cached_prompt
            outputs.append((seq, result))
        return outputs

    def _take(self, message: tuple) -> None:
        """Gauges apply in the order the engine sent them; steps wait in the inbox for `step`."""
        if message[0] == "gauges":
            self._waiting, self._kv_usage = message[1], message[2]
            return
        if message[0] == "step":
            self.last, self._waiting, self._kv_usage = message[2], message[3], message[4]
        self._inbox.append(message)

    def step_ready(self) -> bool:
        """Whether `step` returns (or raises) without waiting: a step's message has come, or the engine is gone."""
        self._read_ahead()
        return bool(self._inbox) or self.gone

    def _read_ahead(self) -> None:
        """Take what the engine has sent so far (the gauges after its last aborts), without waiting."""
        try:
            while not self.gone and self.conn.poll():
                self._take(self.conn.recv())
        except (EOFError, OSError):
            self.gone = True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process (after the drain: nothing runs there any more)."""
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:
            raise EngineFailed(self._gone()) from None

    def _gone(self) -> str:
        self.process.join(1)
        return f"the engine process exited (exit code {self.process.exitcode})"


def start(load: Callable[[], Any], config: ServerConfig,
          log_level: int) -> tuple[EngineView, RemoteBatch, dict[str, float]]:
    """Start the engine process (a fresh interpreter: CUDA does not survive a fork), load and warm the engine
    there, and return once it serves, with the sampling defaults it set up; its load error is raised here as it
    was raised there."""
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=engine_main, args=(there, load, config, log_level), name="ddtree-engine",
                              daemon=True)
    process.start()
    there.close()
    try:
        message = here.recv()
    except EOFError:
        process.join(5)
        raise DDTreeError(f"the engine process exited while loading (exit code {process.exitcode})") from None
    if message[0] == "load_failed":
        process.join(5)
        raise message[1]
    _, view, defaults = message
    return view, RemoteBatch(here, process, config.batch.max_num_seqs), defaults


def engine_main(conn: Connection, load: Callable[[], Any], config: ServerConfig, log_level: int) -> None:
    """The engine process: load, set up, then step while there are requests, one message out a step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end drains first
    logging.basicConfig(level=log_level, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        engine = load()
        batch, defaults = set_up(config, engine)
    except BaseException as exc:
        error = exc if isinstance(exc, DDTreeError) else DDTreeError(f"{type(exc).__name__}: {exc}")
        conn.send(("load_failed", error))
        return
    conn.send(("ready", EngineView.of(engine), defaults))
    with contextlib.suppress(EOFError, OSError):  # the front end is gone: nothing is left to serve
        _serve(conn, batch)


class _Channel:
    """The engine's end of the pipe, which never blocks in a send while the front end blocks in one.

    The front end's event loop sends a request as it comes, and reads the engine only between its own sends. A long
    prompt beyond the pipe's buffer blocks the front end until this process reads it; a step's message beyond the
    buffer would block this process until the front end reads: each waiting on the other for ever. So a message
    too large for the buffer goes out from a thread while this one keeps reading (vLLM's engine core has I/O
    threads for the same reason); the usual small one goes out directly, with no thread hand-off on the way."""

    DIRECT_BYTES = 64 * 1024  # a socket pair's buffer holds at least this much beside what it already holds

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._received: deque[tuple] = deque()  # read while a large message went out

    def poll(self) -> bool:
        return bool(self._received) or self.conn.poll()

    def recv(self) -> tuple:
        return self._received.popleft() if self._received else self.conn.recv()

    def send(self, message: tuple) -> None:
        payload = ForkingPickler.dumps(message)
        if len(payload) <= self.DIRECT_BYTES:
            self.conn.send_bytes(payload)
            return
        failed: list[BaseException] = []
        sender = threading.Thread(target=self._send_bytes, args=(payload, failed), name="ddtree-engine-send")
        sender.start()
        while sender.is_alive():
            if self.conn.poll(0.001):
                self._received.append(self.conn.recv())
        if failed:
            raise failed[0]

    def _send_bytes(self, payload: bytes, failed: list[BaseException]) -> None:
        try:
            self.conn.send_bytes(payload)
        except OSError as exc:  # the front end is gone: the serving loop ends on it
            failed.append(exc)


def _serve(pipe: Connection, batch: Any) -> None:
    conn = _Channel(pipe)
    live: dict[int, Any] = {}  # request id -> the batch engine's sequence
    ids: dict[Any, int] = {}
    said = (0, 0.0)  # the gauges the front end has last been sent

    def gauges() -> tuple[int, float]:
        return batch.waiting, batch.kv_usage

    while True:
        failed: list[tuple[int, str, None]] = []
        while not (live and not conn.poll()) and not (failed and not live):
            if not live and not conn.poll() and (now := gauges()) != said:  # idle: the aborts freed blocks
                said = now
                conn.send(("gauges", *said))
            message = conn.recv()
            if message[0] == "stop":
                return
            if message[0] == "add":
                _, seq_id, prompt_ids, params, cache_salt = message
                try:
                    seq = batch.add(prompt_ids, params, cache_salt=cache_salt)
                except Exception as exc:  # a bad request the front end's checks missed: it alone fails
                    failed.append((seq_id, str(exc), None))
                else:
                    live[seq_id], ids[seq] = seq, seq_id
            elif (seq := live.pop(message[1], None)) is not None:  # abort
                ids.pop(seq, None)
                batch.abort(seq)
        if not live:
            said = gauges()
            conn.send(("step", failed, batch.last, *said))
            continue
        try:
            outputs = batch.step()
        except Exception as exc:  # every request in the engine ends with the error; the engine goes on
            log.exception("engine step failed")
            for seq in live.values():
                batch.abort(seq)
            live.clear()
            ids.clear()
            conn.send(("failed", str(exc)))
            continue
        items = failed
        for seq, out in outputs:
            seq_id = ids.get(seq)
            if seq_id is None:
                continue
            if isinstance(out, Exception) or out.finish_reason is not None:
                del live[seq_id], ids[seq]
            items.append((seq_id, str(out) if isinstance(out, Exception) else out,
                          seq.cached_prompt if not isinstance(out, Exception) and out.is_prefill else None))
        said = gauges()
        conn.send(("step", items, batch.last, *said))

