"""The scheduler against a scripted engine: failures stay contained, stops cut rounds, cancels free work, the
drain timeout ends everything with a retryable error. Each test runs under both drivers: the worker thread over an
engine in the same process, and the event loop over an engine process's pipe (here its serving loop in a thread)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from ddtree.api import engine_process
from ddtree.api.loop_scheduler import LoopScheduler
from ddtree.api.metrics import ServerMetrics
from ddtree.api.scheduler import Draining, Output, Request, Scheduler, SpecStats
from ddtree.core.sampling import SamplingParams
from scripted_engine import ScriptedBatch, ScriptedEngine, prefill, round_


def counter(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels}) or 0.0


async def collect(request: Request) -> list[Output]:
    outs = []
    while not outs or outs[-1].finish_reason is None:
        outs.append(await asyncio.wait_for(request.outputs.get(), 10))
    return outs


class EngineThread(threading.Thread):
    """The engine process's serving loop in a thread: what RemoteBatch needs of a process."""

    exitcode = 0

    def __init__(self, conn: Any, batch: ScriptedBatch) -> None:
        super().__init__(daemon=True)
        self.conn, self.batch = conn, batch

    def run(self) -> None:
        with contextlib.suppress(EOFError, OSError):  # as the engine process: the front end has gone
            engine_process._serve(self.conn, self.batch)

    def kill(self) -> None:
        pass


@pytest.fixture(params=["thread", "loop"])
def driver(request: pytest.FixtureRequest) -> str:
    return request.param


Run = Callable[[Coroutine], Any]


def make(engine: ScriptedEngine, driver: str, max_num_seqs: int = 1) -> tuple[Scheduler, ServerMetrics, Run]:
    """A scheduler over the scripted engine, and how to run a test's coroutine under it."""
    metrics = ServerMetrics("m", method="ddtree", budget=4, block_size=4, max_model_len=64)
    options = dict(max_queue=4, eos_token_ids=engine.eos_token_ids, spec=lambda: SpecStats("ddtree", 4, 4))
    batch = ScriptedBatch(engine, max_num_seqs)
    if driver == "thread":
        return Scheduler(batch, engine.decode, metrics, **options), metrics, asyncio.run
    here, there = multiprocessing.Pipe()
    thread = EngineThread(there, batch)
    thread.start()
    loop = asyncio.new_event_loop()
    remote = engine_process.RemoteBatch(here, thread, max_num_seqs)
    return LoopScheduler(remote, engine.decode, metrics, loop=loop, **options), metrics, loop.run_until_complete


def eventually(condition: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def stop(scheduler: Scheduler) -> None:
    scheduler.shutdown(1)
    if isinstance(scheduler.batch, engine_process.RemoteBatch):
        scheduler.batch.close(1)


def test_engine_failure_fails_that_request_only(driver):
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), RuntimeError("boom")], [prefill(0), round_([1, 2], "length")]]
    scheduler, metrics, run = make(engine, driver)

    async def main():
        bad, good = Request([5], SamplingParams()), Request([5], SamplingParams())
        scheduler.submit(bad)
        scheduler.submit(good)
        return await collect(bad), await collect(good)

    bad, good = run(main())
    assert bad[-1].finish_reason == "abort" and "boom" in bad[-1].error
    assert "".join(o.text for o in good) == "a b c" and good[-1].finish_reason == "length"
    assert counter(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert all(g.closed for g in engine.generations)
    stop(scheduler)


def test_stop_string_cuts_the_round_and_only_kept_tokens_count(driver):
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), round_([1, 2, 3, 4]), round_([5], "length")]]
    scheduler, _, run = make(engine, driver)

    async def main():
        request = Request([5], SamplingParams(), stop=("STOP",))
        scheduler.submit(request)
        return request, await collect(request)

    request, outs = run(main())
    assert "".join(o.text for o in outs) == "a b c "
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "STOP"
    assert request.completion_tokens == 4  # "a", " b", " c", " STOP": " d" was never emitted
    assert engine.generations[0].closed  # the engine stops instead of decoding to max_tokens
    stop(scheduler)


def test_cancelling_a_running_request_stops_its_generation(driver):
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), *[round_([1]) for _ in range(50)]]]
    scheduler, metrics, run = make(engine, driver)

    async def main():
        request = Request([5], SamplingParams())
        scheduler.submit(request)
        engine.gate.release()  # the prefill only
        first = await asyncio.wait_for(request.outputs.get(), 10)
        scheduler.cancel(request)
        engine.gate.release()  # the round already under way when the client left
        return first, await collect(request)

    first, outs = run(main())
    assert first.text == "a"
    assert outs[-1].finish_reason == "abort" and outs[-1].error is None
    # At most the round under way when the client left ran; the other 49 never did.
    eventually(lambda: engine.generations[0].closed)  # an engine process hears of the abort a moment later
    assert len(list(engine.generations[0].rounds)) >= 49
    assert counter(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert counter(metrics, "vllm:num_requests_running") == 0
    stop(scheduler)


def test_the_last_request_cancelled_leaves_the_gauges_at_idle(driver):
    """Regression: a step that only aborted (every client gone) returned before refreshing the gauges, so
    kv_cache_usage_perc kept the aborted requests' blocks until the next request came."""
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), *[round_([1]) for _ in range(50)]] for _ in range(2)]
    scheduler, metrics, run = make(engine, driver, max_num_seqs=2)

    async def main():
        requests = [Request([5], SamplingParams()) for _ in range(2)]
        for request in requests:
            scheduler.submit(request)
        # Both prefills, and a round of the first: an engine process may step on the first add before the second
        # comes, and then runs that round before the second's prefill.
        engine.gate.release(3)
        for request in requests:
            await asyncio.wait_for(request.outputs.get(), 10)
        assert counter(metrics, "vllm:kv_cache_usage_perc") == 1.0
        for request in requests:
            scheduler.cancel(request)
        # The rounds under way when the clients left, and more: an engine process may take the two aborts on
        # either side of a step.
        engine.gate.release(8)
        outs = [await collect(request) for request in requests]
        # An engine process reports its freed blocks once it has taken the aborts: soon, not at a next request.
        deadline = time.monotonic() + 10
        while counter(metrics, "vllm:kv_cache_usage_perc") != 0.0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return outs

    for outs in run(main()):
        assert outs[-1].finish_reason == "abort"
    assert counter(metrics, "vllm:kv_cache_usage_perc") == 0.0
    assert counter(metrics, "vllm:num_requests_running") == 0 and counter(metrics, "vllm:num_requests_waiting") == 0
    stop(scheduler)


def test_spec_counters_follow_the_rounds(driver):
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), round_([1, 2, 4]), round_([5], "length")]]
    scheduler, metrics, run = make(engine, driver)

    async def main():
        request = Request([5, 6], SamplingParams())
        scheduler.submit(request)
        await collect(request)
        return request

    request = run(main())
    assert counter(metrics, "vllm:spec_decode_num_drafts_total") == 2
    assert counter(metrics, "vllm:spec_decode_num_draft_tokens_total") == 6
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 1
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0
    assert counter(metrics, "vllm:prompt_tokens_total") == 2
    assert request.spec.to_dict()["acceptance_length"] == 2.0
    assert request.spec.accepted_length_counts == [1, 0, 1]
    stop(scheduler)


def test_abort_all_ends_waiting_and_running_requests_with_a_retryable_error(driver):
    """The drain timeout: the waiting request ends at once, the running one before its next round, both with
    the reason and as retryable (a 503); new work is refused."""
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), *[round_([1]) for _ in range(50)]], [prefill(0), round_([1], "length")]]
    scheduler, metrics, run = make(engine, driver)

    async def main():
        running, waiting = Request([5], SamplingParams()), Request([5], SamplingParams())
        scheduler.submit(running)
        scheduler.submit(waiting)
        engine.gate.release()  # the prefill only
        await asyncio.wait_for(running.outputs.get(), 10)
        scheduler.abort_all("shutting down")
        ended = await collect(waiting)  # before the running request's round is let through
        engine.gate.release()
        with pytest.raises(Draining):
            scheduler.submit(Request([5], SamplingParams()))
        return await collect(running), ended

    running, waiting = run(main())
    for outs in (running, waiting):
        assert outs[-1].finish_reason == "abort" and outs[-1].error == "shutting down" and outs[-1].retryable
    assert len(engine.generations) == 1  # the waiting one never started
    eventually(lambda: engine.generations[0].closed)
    assert counter(metrics, "vllm:request_success_total", finished_reason="abort") == 2
    stop(scheduler)


def test_a_request_after_every_client_left_is_served_in_full(driver):
    """The round the engine was running when the last client left comes back to nobody (an engine process sends
    it anyway); the next request still gets its own tokens, in order, and nothing of the one before."""
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), *[round_([1]) for _ in range(50)]],
                      [prefill(2), round_([1, 2]), round_([0], "length")]]
    scheduler, metrics, run = make(engine, driver)

    async def main():
        left = Request([5], SamplingParams())
        scheduler.submit(left)
        engine.gate.release()  # its prefill
        await asyncio.wait_for(left.outputs.get(), 10)
        scheduler.cancel(left)
        engine.gate.release(2)  # the round under way, and one more for an engine process that steps on
        await collect(left)
        after = Request([7], SamplingParams())
        scheduler.submit(after)
        engine.gate.release(3)
        return await collect(after)

    outs = run(main())
    assert "".join(o.text for o in outs) == " c b ca" and outs[-1].finish_reason == "length"
    assert counter(metrics, "vllm:request_success_total", finished_reason="length") == 1
    stop(scheduler)
