"""Process lifecycle: SIGTERM drains in-flight requests and ends what the drain timeout cuts with a proper error;
a bad model path or a damaged checkpoint fails fast, in one line, with exit status 2."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from ddtree.engine.engine import ASSETS
from servers import metric, start_server, wait_for


@pytest.mark.slow
def test_sigterm_lets_the_running_stream_finish(logs):
    srv = start_server(logs, "--drain-timeout", "300", name="drain")
    try:
        body = {"model": "ddtree-demo", "prompt": "import os", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with srv.http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 48
        assert srv.proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health")
    finally:
        srv.stop()


def outcome(kind: str, response: httpx.Response, lines: list[str]) -> str:
    """How a request ended: "done" (the whole reply), "503" (a proper drain error) or "lost" (anything else:
    a cut stream, an empty body, a 500)."""
    if response.status_code == 503:
        return "503" if response.json()["error"]["type"] == "service_unavailable" else "lost"
    if kind == "json":
        return "done" if response.status_code == 200 and response.json()["choices"] else "lost"
    events = [line.removeprefix("data: ") for line in lines if line]
    if response.status_code != 200 or len(events) < 2 or events[-1] != "[DONE]":
        return "lost"
    last = json.loads(events[-2])
    if "error" in last:
        return "503" if last["error"]["type"] == "service_unavailable" else "lost"
    return "done" if last["choices"] and last["choices"][0]["finish_reason"] else "lost"


@pytest.mark.slow
def test_the_drain_timeout_ends_every_request_with_a_proper_error(logs):
    """16 clients, streaming and not, 4 of them hanging up while queued; SIGTERM with --drain-timeout 3. While
    draining the server keeps answering (/health 200, /ready 503, new work 503); at the timeout every
    unfinished request ends with a 503 (a stream: an error event, then [DONE]); none is cut, the process exits
    with 0 and the log has no traceback."""
    srv = start_server(logs, "--drain-timeout", "3", name="drain-timeout")
    url = f"{srv.url}/v1/completions"
    long = {"model": "ddtree-demo", "prompt": "import os", "max_tokens": 1000, "temperature": 1, "ignore_eos": True}
    outcomes: list[str] = []
    all_in = threading.Event()
    hang_ups = (3, 6, 9, 12)

    def queued() -> float:
        return metric(srv, "vllm:num_requests_waiting") + metric(srv, "vllm:num_requests_running")

    def hang_up(body: dict) -> None:
        """Send the request, wait until every client's is in, then close the connection."""
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            assert all_in.wait(120)

    def client(i: int) -> None:
        kind = "stream" if i % 2 == 0 else "json"
        body = {**long, "seed": i, "n": 2 if i == 0 else 1, "stream": kind == "stream",
                "max_tokens": 1000 if i < 8 else 16}
        if i in hang_ups:
            hang_up(body)
            return
        with httpx.Client(timeout=120) as http, http.stream("POST", url, json=body) as r:
            streamed = kind == "stream" and r.status_code == 200
            lines = list(r.iter_lines()) if streamed else []
            if not streamed:
                r.read()
        outcomes.append(outcome(kind, r, lines))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        threads[0].start()  # two long choices: they cannot both finish within 3 s
        wait_for(lambda: queued() == 2)
        for thread in threads[1:]:
            thread.start()
        wait_for(lambda: queued() == 17)
        all_in.set()
        wait_for(lambda: queued() == 17 - len(hang_ups))  # the clients that left are out of the queue
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert httpx.get(f"{srv.url}/health").status_code == 200  # the listener is still open
        assert httpx.get(f"{srv.url}/ready").status_code == 503
        refused = httpx.post(url, json={**long, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        for thread in threads:
            thread.join(timeout=120)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()
    assert len(outcomes) == 12 and outcomes.count("lost") == 0, outcomes
    assert outcomes.count("503") >= 2  # at least client 0 and the one running were cut by the timeout
    log = srv.log.read_text()
    assert "drain timeout: ending" in log
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_bad_model_path_exits_with_a_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ddtree.cli", "serve", "--target", str(tmp_path / "missing"),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("ddtree serve: error:")


def damaged_copy(tmp_path, which: str, cut: int | None = None, header: bool = False):
    """A copy of the demo pair's target or draft with a damaged model.safetensors (truncated, as an interrupted
    pull leaves it, or with a corrupt header)."""
    copy = tmp_path / which
    shutil.copytree(ASSETS / which, copy)
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"#" * 16 + data[24:] if header else data[:cut])
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_damaged_checkpoint_fails_in_one_line(tmp_path, command):
    """Before: a 21-line safetensors traceback and exit 1."""
    args = {"serve": ["serve", "--port", "0"], "generate": ["generate", "--prompt", "x", "--max-new-tokens", "2"]}
    cases = [(["--target", str(damaged_copy(tmp_path, "target", cut=10**7)), "--draft", str(ASSETS / "draft")],
              "is truncated"),
             (["--draft", str(damaged_copy(tmp_path, "draft", header=True))], "corrupt header")]
    for models, words in cases:
        out = subprocess.run([sys.executable, "-m", "ddtree.cli", *args[command], *models], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith(f"ddtree {command}: error:") and words in last and "pull it again" in last, last
        assert "Traceback" not in out.stderr, out.stderr


def test_serve_flags_are_checked_in_one_line():
    for flags, words in ((["--max-request-bytes", "10"], "--max-request-bytes must be at least 1024"),
                         (["--drain-timeout", "-1"], "--drain-timeout must be 0 or more")):
        out = subprocess.run([sys.executable, "-m", "ddtree.cli", "serve", *flags], capture_output=True, text=True,
                             timeout=60)
        error = out.stderr.strip()
        assert out.returncode == 2 and "\n" not in error and error.startswith(f"ddtree serve: error: {words}"), error
