"""The scheduler against a scripted engine: failures stay contained, stops cut rounds, cancels free work, the
drain timeout ends everything with a retryable error."""

from __future__ import annotations

import asyncio
import threading

import pytest
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


def make(engine: ScriptedEngine, max_num_seqs: int = 1) -> tuple[Scheduler, ServerMetrics]:
    metrics = ServerMetrics("m", method="ddtree", budget=4, block_size=4, max_model_len=64)
    scheduler = Scheduler(ScriptedBatch(engine, max_num_seqs), engine.decode, metrics, max_queue=4,
                          eos_token_ids=engine.eos_token_ids, spec=lambda: SpecStats("ddtree", 4, 4))
    return scheduler, metrics


def test_engine_failure_fails_that_request_only():
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), RuntimeError("boom")], [prefill(0), round_([1, 2], "length")]]
    scheduler, metrics = make(engine)

    async def main():
        bad, good = Request([5], SamplingParams()), Request([5], SamplingParams())
        scheduler.submit(bad)
        scheduler.submit(good)
        return await collect(bad), await collect(good)

    bad, good = asyncio.run(main())
    assert bad[-1].finish_reason == "abort" and "boom" in bad[-1].error
    assert "".join(o.text for o in good) == "a b c" and good[-1].finish_reason == "length"
    assert counter(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert all(g.closed for g in engine.generations)
    scheduler.shutdown(1)


def test_stop_string_cuts_the_round_and_only_kept_tokens_count():
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), round_([1, 2, 3, 4]), round_([5], "length")]]
    scheduler, _ = make(engine)

    async def main():
        request = Request([5], SamplingParams(), stop=("STOP",))
        scheduler.submit(request)
        return request, await collect(request)

    request, outs = asyncio.run(main())
    assert "".join(o.text for o in outs) == "a b c "
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "STOP"
    assert request.completion_tokens == 4  # "a", " b", " c", " STOP": " d" was never emitted
    assert engine.generations[0].closed  # the engine stops instead of decoding to max_tokens
    scheduler.shutdown(1)


def test_cancelling_a_running_request_stops_its_generation():
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), *[round_([1]) for _ in range(50)]]]
    scheduler, metrics = make(engine)

    async def main():
        request = Request([5], SamplingParams())
        scheduler.submit(request)
        engine.gate.release()  # the prefill only
        first = await asyncio.wait_for(request.outputs.get(), 10)
        scheduler.cancel(request)
        engine.gate.release()  # the round already under way when the client left
        return first, await collect(request)

    first, outs = asyncio.run(main())
    assert first.text == "a"
    assert outs[-1].finish_reason == "abort" and outs[-1].error is None
    # At most the round under way when the client left ran; the other 49 never did.
    assert engine.generations[0].closed and len(list(engine.generations[0].rounds)) >= 49
    assert counter(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert counter(metrics, "vllm:num_requests_running") == 0
    scheduler.shutdown(1)


def test_the_last_request_cancelled_leaves_the_gauges_at_idle():
    """Regression: a step that only aborted (every client gone) returned before refreshing the gauges, so
    kv_cache_usage_perc kept the aborted requests' blocks until the next request came."""
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), *[round_([1]) for _ in range(50)]] for _ in range(2)]
    scheduler, metrics = make(engine, max_num_seqs=2)

    async def main():
        requests = [Request([5], SamplingParams()) for _ in range(2)]
        for request in requests:
            scheduler.submit(request)
        engine.gate.release(2)  # both prefills
        for request in requests:
            await asyncio.wait_for(request.outputs.get(), 10)
        assert counter(metrics, "vllm:kv_cache_usage_perc") == 1.0
        for request in requests:
            scheduler.cancel(request)
        engine.gate.release(2)  # the rounds under way when the clients left
        return [await collect(request) for request in requests]

    for outs in asyncio.run(main()):
        assert outs[-1].finish_reason == "abort"
    assert counter(metrics, "vllm:kv_cache_usage_perc") == 0.0
    assert counter(metrics, "vllm:num_requests_running") == 0 and counter(metrics, "vllm:num_requests_waiting") == 0
    scheduler.shutdown(1)


def test_spec_counters_follow_the_rounds():
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), round_([1, 2, 4]), round_([5], "length")]]
    scheduler, metrics = make(engine)

    async def main():
        request = Request([5, 6], SamplingParams())
        scheduler.submit(request)
        await collect(request)
        return request

    request = asyncio.run(main())
    assert counter(metrics, "vllm:spec_decode_num_drafts_total") == 2
    assert counter(metrics, "vllm:spec_decode_num_draft_tokens_total") == 6
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 1
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0
    assert counter(metrics, "vllm:prompt_tokens_total") == 2
    assert request.spec.to_dict()["acceptance_length"] == 2.0
    assert request.spec.accepted_length_counts == [1, 0, 1]
    scheduler.shutdown(1)


def test_abort_all_ends_waiting_and_running_requests_with_a_retryable_error():
    """The drain timeout: the waiting request ends at once, the running one before its next round, both with
    the reason and as retryable (a 503); new work is refused."""
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), *[round_([1]) for _ in range(50)]], [prefill(0), round_([1], "length")]]
    scheduler, metrics = make(engine)

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

    running, waiting = asyncio.run(main())
    for outs in (running, waiting):
        assert outs[-1].finish_reason == "abort" and outs[-1].error == "shutting down" and outs[-1].retryable
    assert len(engine.generations) == 1 and engine.generations[0].closed  # the waiting one never started
    assert counter(metrics, "vllm:request_success_total", finished_reason="abort") == 2
    scheduler.shutdown(1)
