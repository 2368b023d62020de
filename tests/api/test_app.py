"""The app in-process with a scripted engine: loading states, load failure, a failure after streaming began."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from ddtree.api.app import create_app
from ddtree.api.config import ServerConfig
from fastapi.testclient import TestClient
from scripted_engine import ScriptedEngine, prefill, round_
from servers import wait_ready


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


class Caller:
    """One API call on the app's ASGI interface by a client that hangs up when told to (TestClient cannot)."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.app, self.path, self.body = app, path, json.dumps(body).encode()
        self.messages: list[dict] = []  # what the app sent
        self.gone = asyncio.Event()
        self._asked = False

    async def receive(self) -> dict:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.messages.append(message)

    async def run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("test", 80),
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(self.body)).encode())]}
        await self.app(scope, self.receive, self.send)

    def token_ids(self) -> list[int]:
        """The token ids of the stream's events the client got (return_token_ids)."""
        text = b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body").decode()
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        return [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]


async def until(check, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("stream", [True, False])
def test_tokens_decoded_for_a_client_that_left_are_not_counted_as_generated(stream):
    """vllm:generation_tokens counts the tokens returned to clients: not the round that was under way when a
    client hung up, nor what a non-streaming client never got its reply for."""
    engine = ScriptedEngine()
    engine.gate = threading.Semaphore(0)
    engine.scripts = [[prefill(0), round_([1, 2]), *[round_([3]) for _ in range(20)]]]
    app = create_app(lambda: engine)
    state = app.state.ddtree

    def sample(name: str, **labels: str) -> float:
        return state.metrics.registry.get_sample_value(name, {"model_name": "scripted", "engine": "0", **labels})

    async def main() -> list[int]:
        async with app.router.lifespan_context(app):
            await until(lambda: state.scheduler is not None)
            caller = Caller(app, "/v1/completions", {"model": "scripted", "prompt": [0], "max_tokens": 30,
                                                     "stream": stream, "return_token_ids": True})
            call = asyncio.create_task(caller.run())
            engine.gate.release(2)  # the prefill and the first round reach the client
            if stream:
                await until(lambda: caller.token_ids() == [0, 1, 2])
            else:
                await until(lambda: sample("vllm:spec_decode_num_drafts_total") == 1)
            caller.gone.set()
            await asyncio.sleep(0.05)  # the server notices
            engine.gate.release()  # the round under way when the client left
            await until(lambda: sample("vllm:request_success_total", finished_reason="abort") == 1)
            await asyncio.wait_for(call, 10)
            return caller.token_ids()

    received = asyncio.run(main())
    assert received == ([0, 1, 2] if stream else [])
    assert sample("vllm:generation_tokens_total") == len(received)
