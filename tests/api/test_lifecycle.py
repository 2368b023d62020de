"""Process lifecycle: SIGTERM drains in-flight requests before exit; a bad model path fails fast."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest
from conftest import start_server


@pytest.mark.slow
def test_sigterm_lets_the_running_stream_finish(logs):
    srv = start_server(logs, "--drain-timeout", "300", name="drain")
    try:
        body = {"prompt": "import os", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with srv.http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 48
        srv.proc.wait(timeout=60)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health")
    finally:
        srv.stop()


def test_bad_model_path_exits_with_a_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ddtree.cli", "serve", "--target", str(tmp_path / "missing"),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("ddtree serve: error:")
