"""The app in-process with a scripted engine: loading states, load failure, a failure after streaming began."""

from __future__ import annotations

import json
import threading
import time

from ddtree.api.app import create_app
from ddtree.api.state import ServerConfig
from fastapi.testclient import TestClient
from scripted_engine import ScriptedEngine, prefill, round_


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 10
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.01)


def test_health_answers_while_loading_and_ready_follows_the_model():
    loaded = threading.Event()
    engine = ScriptedEngine()

    def load() -> ScriptedEngine:
        loaded.wait(10)
        return engine

    with TestClient(create_app(load)) as client:
        assert client.get("/health").status_code == 200
        for path in ("/ready", "/v1/models", "/metrics"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["error"]["message"], path
        r = client.post("/v1/completions", json={"model": "scripted", "prompt": [0, 1], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["Retry-After"]
        loaded.set()
        wait_ready(client)
        assert client.get("/v1/models").json()["data"][0]["id"] == "scripted"


def test_load_failure_is_reported_and_never_ready():
    errors = []
    done = threading.Event()

    def load():
        raise OSError("no such checkpoint")

    def on_load_error(exc: BaseException) -> None:
        errors.append(exc)
        done.set()

    with TestClient(create_app(load, on_load_error=on_load_error)) as client:
        assert done.wait(10)
        r = client.get("/ready")
        assert r.status_code == 503 and "no such checkpoint" in r.json()["error"]["message"]
    assert str(errors[0]) == "no such checkpoint"


def test_engine_failure_mid_stream_sends_an_error_event_then_done():
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), round_([1, 2]), RuntimeError("device lost")], [prefill(0), round_([1], "length")]]
    with TestClient(create_app(lambda: engine)) as client:
        wait_ready(client)
        body = {"model": "scripted", "prompt": [0], "max_tokens": 10, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
        assert "".join(texts) == "a b c"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_error" and "device lost" in error["message"]
        assert events[-1] == "[DONE]"
        # The worker survived: the next request is served.
        r = client.post("/v1/completions", json={"model": "scripted", "prompt": [0], "max_tokens": 10})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a b"


def test_default_temperature_applies_only_to_requests_that_send_none():
    engine = ScriptedEngine()
    engine.scripts = [[prefill(0), round_([1], "length")] for _ in range(3)]
    app = create_app(lambda: engine, ServerConfig(default_temperature=0.0))
    with TestClient(app) as client:
        wait_ready(client)
        for extra in ({}, {"temperature": 0.7}):
            body = {"model": "scripted", "prompt": [0], "max_tokens": 5, **extra}
            assert client.post("/v1/completions", json=body).status_code == 200
    with TestClient(create_app(lambda: engine)) as client:
        wait_ready(client)
        body = {"model": "scripted", "prompt": [0], "max_tokens": 5}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert [p.temperature for p in engine.params] == [0.0, 0.7, 1.0]


def test_docs_describe_the_request_bodies_and_can_be_turned_off():
    with TestClient(create_app(lambda: ScriptedEngine())) as client:
        assert client.get("/docs").status_code == 200
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        assert {"ChatCompletionRequest", "CompletionRequest", "TokenizeRequest"} <= set(schemas)
    with TestClient(create_app(lambda: ScriptedEngine(), ServerConfig(docs=False))) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 404, path
