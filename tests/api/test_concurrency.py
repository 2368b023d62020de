"""64 concurrent streams on one batching server, a seeded subset of them hanging up mid-stream: every stream that
completes gets the text the same request gets alone, every hang-up is counted as an abort, and the server ends
idle with every KV block back (`vllm:kv_cache_usage_perc` is 1 - free / total blocks: exactly 0 only when
none is held), ready for the next burst."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import httpx
import pytest
from servers import Server, metric, start_server, wait_for

STREAMS = 64
HANGUPS = 16
LONG = 400  # hang-ups ask for this many tokens (ignore_eos): they are still decoding when their client leaves


def completion(prompt: str, max_tokens: int, n: int = 1) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "n": n}


def chat(content: str, max_tokens: int, n: int = 1) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "n": n}


# Mixed prompts, lengths and choice counts; each stream sends one of these, greedily.
REQUESTS = [completion("import os", 12), completion("def fib(n):", 7, n=2), completion("class Stack:", 16),
            completion("for i in range(10):\n    ", 5), chat("Write a function.", 10), chat("Sort a list.", 6, n=2),
            completion("# A queue of jobs\nfrom collections import deque\n", 9)]
LONG_REQUESTS = [completion("import sys", LONG), completion("while True:", LONG, n=2), chat("Explain recursion.", LONG)]


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("concurrency"), "--max-num-seqs", "64", "--max-queue", "128",
                       name="concurrency")
    yield srv
    srv.stop()


async def stream(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None = None) -> dict | None:
    """The choices' texts and finish reasons of one streamed request; with `hang_up_after`, the client closes the
    connection after that many chunks with text instead (None)."""
    chat_request = "messages" in body
    path = "/v1/chat/completions" if chat_request else "/v1/completions"
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    seen = 0
    async with client.stream("POST", url + path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        if hang_up_after == 0:
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                piece = choice["delta"].get("content") if chat_request else choice["text"]
                if piece:
                    texts[choice["index"]] = texts.get(choice["index"], "") + piece
                    seen += 1
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
            if hang_up_after is not None and seen >= hang_up_after:
                return None  # leaving the block closes the connection mid-stream
    return {"texts": [texts.get(i, "") for i in range(body["n"])], "finish": [finish[i] for i in range(body["n"])]}


async def burst(url: str, bodies: list[dict], hang_ups: dict[int, int]) -> list[dict | None]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        return await asyncio.gather(*(stream(client, url, body, hang_ups.get(i)) for i, body in enumerate(bodies)))


def assert_idle_with_no_blocks_held(srv: Server) -> None:
    """Nothing runs or waits, and the engine holds no block (its gauges reach the front end once it is idle)."""
    wait_for(lambda: metric(srv, "vllm:num_requests_running") == 0 and metric(srv, "vllm:num_requests_waiting") == 0
             and metric(srv, "vllm:kv_cache_usage_perc") == 0.0)


@pytest.mark.slow
def test_64_streams_with_hang_ups_lose_nothing_and_leak_no_blocks(batching_server):
    srv = batching_server
    model = srv.model()
    rng = random.Random(42)
    hang_ups = {i: rng.randrange(4) for i in rng.sample(range(STREAMS), HANGUPS)}  # stream -> chunks before leaving
    picks = {i: (LONG_REQUESTS[i % len(LONG_REQUESTS)] if i in hang_ups else REQUESTS[i % len(REQUESTS)])
             for i in range(STREAMS)}
    bodies = [{**picks[i], "model": model, "temperature": 0, "ignore_eos": i in hang_ups} for i in range(STREAMS)]
    aborted = metric(srv, "vllm:request_success_total", finished_reason="abort")
    finished = metric(srv, "vllm:request_success_total", finished_reason="length") + metric(
        srv, "vllm:request_success_total", finished_reason="stop")

    results = asyncio.run(burst(srv.url, bodies, hang_ups))

    # Every hang-up, each of its choices, ended as an abort; every other choice ran to its end.
    assert metric(srv, "vllm:request_success_total", finished_reason="abort") - aborted == sum(
        bodies[i]["n"] for i in hang_ups)
    completed = [i for i in range(STREAMS) if i not in hang_ups]
    assert all(results[i] is not None for i in completed)
    assert metric(srv, "vllm:request_success_total", finished_reason="length") + metric(
        srv, "vllm:request_success_total", finished_reason="stop") - finished == sum(bodies[i]["n"] for i in completed)
    assert_idle_with_no_blocks_held(srv)

    # Greedy is lossless under batching: each request alone on the idle server gives the same choices.
    alone = {json.dumps(r): asyncio.run(burst(srv.url, [{**r, "model": model, "temperature": 0}], {}))[0]
             for r in REQUESTS}
    for i in completed:
        expected = alone[json.dumps(picks[i])]
        assert results[i] == expected, (i, picks[i])
        assert len(set(expected["texts"])) == 1  # greedy: the n choices agree

    # The next burst is served in full and alike.
    again = [{**r, "model": model, "temperature": 0} for r in REQUESTS]
    assert asyncio.run(burst(srv.url, again, {})) == [alone[json.dumps(r)] for r in REQUESTS]
    assert_idle_with_no_blocks_held(srv)

    # The last client leaving mid-stream leaves the server idle too (the gauges once kept its blocks).
    aborted = metric(srv, "vllm:request_success_total", finished_reason="abort")
    asyncio.run(burst(srv.url, [{**LONG_REQUESTS[0], "model": model, "ignore_eos": True}], {0: 2}))
    wait_for(lambda: metric(srv, "vllm:request_success_total", finished_reason="abort") == aborted + 1)
    assert_idle_with_no_blocks_held(srv)
