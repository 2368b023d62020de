"""Bounded work per request: bodies over --max-request-bytes get a 413 unread, prompts that cannot fit the context
are refused before they are tokenized, and the parsing and tokenizing a huge request still costs happens off
the event loop, so it holds up neither /health nor another client's stream."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from servers import metric, wait_for

LIMIT = 4 * 2**20  # the default --max-request-bytes


def post_raw(server, path: str, body: bytes | Iterator[bytes]) -> httpx.Response:
    return server.http.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"})


def test_a_body_over_the_limit_gets_413_unread(server):
    huge = json.dumps({"model": server.model(), "messages": [{"role": "user", "content": "x" * 10**7}]}).encode()
    r = post_raw(server, "/v1/chat/completions", huge)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and "--max-request-bytes" in r.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: refused once the bytes pass the limit
        yield b'{"model": "ddtree-demo", "prompt": "'
        for _ in range(LIMIT // 2**16 + 16):
            yield b"x" * 2**16
        yield b'"}'

    assert post_raw(server, "/v1/completions", chunked()).status_code == 413
    ok = post_raw(server, "/v1/completions", json.dumps({"model": server.model(), "prompt": "x = 1",
                                                         "max_tokens": 2}).encode())
    assert ok.status_code == 200


def test_prompts_that_cannot_fit_are_refused_from_their_size(server):
    limit = server.http.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    ids = post_raw(server, "/v1/completions", json.dumps({"model": server.model(), "prompt": [7] * 500_000}).encode())
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
    assert f"maximum context length is {limit} tokens. However, your prompt has 500000 tokens" in ids.text
    text = post_raw(server, "/v1/completions",
                    json.dumps({"model": server.model(), "prompt": "word " * 400_000}).encode())
    assert text.status_code == 400 and "your prompt has at least" in text.json()["error"]["message"]
    chat = post_raw(server, "/v1/chat/completions", json.dumps({"model": server.model(), "messages": [
        {"role": "system", "content": "word " * 200_000}, {"role": "user", "content": [
            {"type": "text", "text": "word " * 200_000}]}]}).encode())
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    # A prompt within the context is not refused by the bound: it is tokenized and counted exactly.
    r = post_raw(server, "/v1/completions", json.dumps({"model": server.model(), "prompt": "x" * 200,
                                                        "max_tokens": 1}).encode())
    assert r.status_code == 200


def watch(server, during: Callable[[], None]) -> tuple[float, float]:
    """(the slowest /health answer, the longest pause between two chunks of a running stream) while `during`
    runs in this thread."""
    done = threading.Event()
    probes: list[float] = []
    gaps: list[float] = []
    streaming = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(f"{server.url}/health").status_code == 200
                probes.append(time.monotonic() - started)
                done.wait(0.02)

    def stream() -> None:
        body = {"model": server.model(), "prompt": "import os", "max_tokens": 1000, "temperature": 1, "seed": 3,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client, client.stream("POST", f"{server.url}/v1/completions",
                                                                json=body) as r:
            lines = (line for line in r.iter_lines() if line)
            next(lines)  # the first chunk (after the prefill)
            last = time.monotonic()
            streaming.set()
            for _ in lines:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if done.is_set():
                    return  # hanging up cancels the rest

    threads = [threading.Thread(target=probe), threading.Thread(target=stream)]
    for thread in threads:
        thread.start()
    assert streaming.wait(120)
    try:
        during()
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=120)
    # The stream's last round ends after the hang-up: leave the server idle for the next test's counters.
    wait_for(lambda: metric(server, "vllm:num_requests_running") == 0)
    assert probes and gaps
    return max(probes), max(gaps)


@pytest.mark.slow
def test_a_huge_request_holds_up_neither_health_nor_another_stream(server):
    """Before: a 10 MB chat held the event loop 16-51 s (no /health, other streams frozen). The bound is
    relative to the same measurement with nothing huge going on, and generous for a loaded CI machine."""
    model = server.model()
    huge = {
        "/v1/chat/completions": [  # 413 unread; then a chat refused by the context bound
            json.dumps({"model": model, "messages": [{"role": "user", "content": "word " * 2_000_000}]}),
            json.dumps({"model": model, "messages": [{"role": "user", "content": "word " * 800_000}]})],
        "/v1/completions": [json.dumps({"model": model, "prompt": list(range(1000)) * 500})],
        "/tokenize": [json.dumps({"model": model, "prompt": "word " * 800_000})],  # tokenized whole: seconds
    }
    statuses: list[int] = []

    def send_huge() -> None:
        for path, bodies in huge.items():
            for body in bodies:
                statuses.append(post_raw(server, path, body.encode()).status_code)

    base_health, base_gap = watch(server, lambda: time.sleep(3))
    health, gap = watch(server, send_huge)
    assert statuses == [413, 400, 400, 200]
    assert health < base_health + 1.5, (health, base_health)
    assert gap < base_gap + 1.5, (gap, base_gap)
