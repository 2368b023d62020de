"""The engine in a process of its own (api/engine_process.py): what clients get is what the one-process server
gives them, a request the front end ends while the engine runs ahead frees its blocks, and an engine process
that dies ends the requests in flight with an error and fails liveness instead of hanging."""

from __future__ import annotations

import functools
import json
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ddtree.api import engine_process
from ddtree.api.app import create_app
from ddtree.api.config import ServerConfig
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from fastapi.testclient import TestClient
from scripted_engine import ScriptedBatch, ScriptedEngine, prefill, round_
from servers import wait_ready

LOAD = functools.partial(Engine.from_pretrained, device="cpu")
BODIES = [{"model": "ddtree-demo", "prompt": prompt, "max_tokens": tokens, "temperature": 0, **extra}
          for prompt, tokens, extra in (("def fib(n):", 40, {}), ("import numpy as np\n", 30, {"stop": ["\n\n"]}),
                                        ("class Tree:", 48, {"stop": [")"]}), ("for i in range(", 24, {}),
                                        ("The quick brown fox", 32, {"n": 2}))]


def replies(config: ServerConfig) -> list[dict]:
    """The five requests at once, then the gauges once the server is idle again."""
    with TestClient(create_app(LOAD, config)) as client:
        wait_ready(client)
        with ThreadPoolExecutor(len(BODIES)) as pool:
            results = list(pool.map(lambda body: client.post("/v1/completions", json=body), BODIES))
        deadline = time.monotonic() + 10
        while "vllm:kv_cache_usage_perc" not in (text := client.get("/metrics").text) or \
                usage(text) != 0.0:
            assert time.monotonic() < deadline, f"blocks still held: {usage(text)}"
            time.sleep(0.05)
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    return [[(c["text"], c["finish_reason"], c["stop_reason"]) for c in r.json()["choices"]] for r in results]


def usage(metrics: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith("vllm:kv_cache_usage_perc"))
    return float(line.split()[-1])


def test_an_engine_process_gives_every_client_what_the_one_process_server_gives():
    apart = replies(ServerConfig(engine_process=True))
    together = replies(ServerConfig(engine_process=False))
    assert apart == together
    assert any(reason == "stop" for reply in apart for _, reason, _ in reply)  # the front end ended some


def test_a_dead_engine_process_ends_the_requests_in_flight_and_fails_liveness():
    with TestClient(create_app(LOAD, ServerConfig(engine_process=True))) as client:
        wait_ready(client)
        process = client.app.state.ddtree.scheduler.batch.process
        body = {"model": "ddtree-demo", "prompt": "def fib(n):", "max_tokens": 400, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            process.kill()
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_error" and "engine process exited" in error["message"]
        assert client.get("/health").status_code == 503
        after = client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert after.status_code == 500 and "engine process exited" in after.json()["error"]["message"]


def test_a_long_prompt_and_a_large_step_crossing_in_the_pipe_do_not_wait_on_each_other():
    """The front end sends a prompt larger than the pipe's buffer while the engine sends a step larger than it:
    the engine keeps reading while its step goes out, so both arrive (before, each side blocked in its send)."""
    engine = ScriptedEngine()
    huge = [1] * 400_000  # a round's tokens: a step message of megabytes
    engine.scripts = [[prefill(0), round_(huge, "length")], [prefill(0), round_([2], "length")]]
    here, there = multiprocessing.Pipe()
    threading.Thread(target=engine_process._serve, args=(there, ScriptedBatch(engine, 2)), daemon=True).start()
    here.send(("add", 0, [5], SamplingParams(), None))
    assert here.recv()[0] == "step"  # the prefill; the engine now sends the large round, which nobody reads yet
    time.sleep(0.2)
    sender = threading.Thread(target=here.send, args=(("add", 1, [5] * 2_000_000, SamplingParams(), None),))
    sender.start()
    sender.join(30)
    assert not sender.is_alive(), "the prompt's send never finished: the engine stopped reading"
    steps = [message for message in (here.recv() for _ in range(3)) if message[0] == "step"]
    rounds = [out.token_ids for step in steps for _, out, _ in step[1]]
    assert huge in rounds and [0] in rounds
    here.send(("stop",))
