"""Overload and disconnects: a full queue answers 429, and a client that goes away frees the engine."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from servers import metric, start_server, wait_for


def long_body(server, stream: bool) -> dict:
    limit = server.http.get(f"{server.url}/v1/models", headers=auth(server)).json()["data"][0]["max_model_len"]
    return {"model": "ddtree-demo", "prompt": "import os", "max_tokens": min(1000, limit - 10), "temperature": 0,
            "ignore_eos": True, "stream": stream}


def auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}"}


@pytest.mark.slow
def test_full_queue_gives_429_and_disconnects_free_the_engine(guarded_server):
    srv = guarded_server
    url = f"{srv.url}/v1/completions"
    aborted = metric(srv, "vllm:request_success_total", finished_reason="abort")
    generated = metric(srv, "vllm:generation_tokens_total")
    body = long_body(srv, stream=True)
    with httpx.Client(timeout=300) as running, running.stream("POST", url, json=body, headers=auth(srv)) as a:
        lines = a.iter_lines()
        assert next(lines).startswith("data: ")  # A is decoding
        # B waits in the one-slot queue...
        done: dict = {}

        def queued() -> None:
            done["response"] = srv.http.post(url, json={**long_body(srv, False), "max_tokens": 8}, headers=auth(srv))

        b = threading.Thread(target=queued)
        b.start()
        wait_for(lambda: metric(srv, "vllm:num_requests_waiting") == 1)
        # ... so C is refused, with a hint of when to come back.
        r = srv.http.post(url, json=long_body(srv, False), headers=auth(srv))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            srv.client().completions.create(model=srv.model(), prompt="x = 1", max_tokens=2)
    # A's client hung up mid-stream: the engine drops it and serves B.
    b.join(timeout=120)
    assert done["response"].status_code == 200 and done["response"].json()["usage"]["completion_tokens"] == 8
    assert metric(srv, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(srv, "vllm:generation_tokens_total") - generated < body["max_tokens"] + 8
    wait_for(lambda: metric(srv, "vllm:num_requests_running") == 0)


@pytest.mark.slow
def test_a_queued_request_whose_client_leaves_is_dropped(guarded_server):
    srv = guarded_server
    url = f"{srv.url}/v1/completions"
    aborted = metric(srv, "vllm:request_success_total", finished_reason="abort")
    with httpx.Client(timeout=300) as running, running.stream("POST", url, json=long_body(srv, True),
                                                             headers=auth(srv)) as a:
        lines = a.iter_lines()  # keep a reference: a collected iterator closes the connection
        next(lines)
        with httpx.Client(timeout=300) as waiting, waiting.stream("POST", url, json=long_body(srv, True),
                                                                 headers=auth(srv)):
            wait_for(lambda: metric(srv, "vllm:num_requests_waiting") == 1)
        # The waiting client left: its queue slot frees up while A still runs.
        wait_for(lambda: metric(srv, "vllm:num_requests_waiting") == 0)
        wait_for(lambda: metric(srv, "vllm:request_success_total", finished_reason="abort") == aborted + 1)
        assert metric(srv, "vllm:num_requests_running") == 1
    wait_for(lambda: metric(srv, "vllm:num_requests_running") == 0)


@pytest.mark.slow
def test_n_choices_are_queued_all_or_none(logs):
    """With one queue slot left, an n = 2 request is refused whole: no choice stays queued behind the 429."""
    srv = start_server(logs, "--max-queue", "2", "--max-num-seqs", "1", name="two-slots")
    url = f"{srv.url}/v1/completions"
    try:
        with httpx.Client(timeout=300) as running, running.stream("POST", url, json=long_body(srv, True)) as a, \
                httpx.Client(timeout=300) as waiting, waiting.stream("POST", url, json=long_body(srv, True)):
            lines = a.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)
            wait_for(lambda: metric(srv, "vllm:num_requests_waiting") == 1)
            r = srv.http.post(url, json={**long_body(srv, False), "n": 2})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert metric(srv, "vllm:num_requests_waiting") == 1 and metric(srv, "vllm:num_requests_running") == 1
    finally:
        srv.stop()
