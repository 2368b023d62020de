"""Real `ddtree serve` processes on free loopback ports: what the tests start and talk to (a module of its
own, not conftest, so test modules import it by a name no other test directory's conftest shadows)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running server: its URL, its process and its log file."""

    url: str
    proc: subprocess.Popen
    log: Path
    api_key: str = "unused"
    _client: openai.OpenAI | None = None
    _model: str | None = None
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=300))  # generous: CI may be slow

    def client(self) -> openai.OpenAI:
        """One SDK client per server: building one (TLS context and all) costs more than a tiny request."""
        if self._client is None:
            self._client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0)
        return self._client

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0)

    def model(self) -> str:
        if self._model is None:
            self._model = self.client().models.list().data[0].id
        return self._model

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, keyed by (name, sorted labels), parsed by prometheus-client."""
        text = self.http.get(f"{self.url}/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


READY_WITHIN_S = 300


def wait_ready(client: httpx.Client, within_s: float = 120) -> None:
    """Until an in-process app (a TestClient) answers /ready with 200; it returns as soon as it does (a busy
    2-core CI host took over 10 s)."""
    deadline = time.monotonic() + within_s
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.01)


def start_server(log_dir: Path, *args: str, env: dict[str, str] | None = None, api_key: str = "unused",
                 name: str = "server", python: tuple[str, ...] = (sys.executable,)) -> Server:
    """`python -m ddtree.cli serve ARGS` on a free port, once /ready answers 200 (`python`: the interpreter's
    command, e.g. through tests/without_packages.py)."""
    port = free_port()
    log = log_dir / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*python, "-m", "ddtree.cli", "serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(f"http://127.0.0.1:{port}", proc, log, api_key)
    # A demo server is ready in 5-25 s alone; on a 2-core CI host beside a worker running interpreted kernels,
    # one warming up the fast path took over 120 s. The wait ends as soon as it answers.
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server not ready after {READY_WITHIN_S} s:\n{log.read_text()}")


def metric(server: Server, name: str, **labels: str) -> float:
    """The sum of a /metrics series over the samples with these labels."""
    return sum(v for (n, lab), v in server.metrics().items()
               if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
