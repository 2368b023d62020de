"""Process-level end to end: run exactly the commands and arguments the rendered pods run (pull from a
local path, then serve the tiny demo pair), with the pod's volume mounts mapped to temporary directories,
and get an OpenAI answer through the rendered probes, port and API key."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from ddtree.models.draft_vocab import write_draft_vocab
from ddtree_operator import render, resource, workload
from k8s_testing import REPO, ddtree_serve_available, free_port, http_get, running

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ddtree_serve_available(), reason="`ddtree serve` is not available yet")]
DEMO = REPO / "server" / "ddtree" / "assets" / "demo"


def localize(container: dict[str, Any], mounts: dict[str, Path], secrets: dict[str, str]) -> tuple[list[str], dict]:
    """The container's command line and environment with its volume mount paths mapped to local dirs."""
    def local(value: str) -> str:
        for mount, path in mounts.items():
            value = value.replace(mount, str(path))
        return value
    argv = [local(a) for a in container["command"] + container["args"]]
    env = {e["name"]: local(e["value"]) if "value" in e else secrets[e["valueFrom"]["secretKeyRef"]["name"]]
           for e in container["env"]}
    return argv, env


def test_rendered_pods_pull_and_serve_the_demo_pair(tmp_path: Path):
    port = free_port()
    body = {"apiVersion": "ddtree.io/v1alpha1", "kind": "DDTreeDeployment",
            "metadata": {"name": "demo", "namespace": "default", "uid": "u"},
            "spec": {"target": {"model": {"uri": str(DEMO / "target")}},
                     "draft": {"model": {"uri": str(DEMO / "draft")}},
                     "decoding": {"draftVocab": {"configMapRef": {"name": "demo-hot"}}, "draftQuantization": "fp8"},
                     "gpu": {"count": 0}, "server": {"port": port, "apiKeySecretRef": {"name": "keys"},
                                                     "drainSeconds": 1, "terminationGracePeriodSeconds": 20,
                                                     "batching": {"maxNumSeqs": 4, "maxNumBatchedTokens": 256,
                                                                  "blockSize": 32}}}}
    children = render.render(body, "ddtree-server:test")
    mounts = {resource.MODELS_DIR: tmp_path / "models", "/cache": tmp_path / "cache",
              workload.DRAFT_VOCAB_DIR: tmp_path / "vocab"}
    (tmp_path / "vocab").mkdir()  # the ConfigMap's key, as the kubelet mounts it
    write_draft_vocab(tmp_path / "vocab" / "draft_vocab.json", range(2048), 8192)
    secrets = {"keys": "sk-test"}

    # The pull Job's container: links the local models into the models volume, twice (idempotent).
    pull, pull_env = localize(children.pull_job["spec"]["template"]["spec"]["containers"][0], mounts, secrets)
    for expected in ("linked", "present"):
        done = subprocess.run(pull, env={**os.environ, **pull_env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stderr.count(f": {expected}") == 2, done.stderr

    # The server container, probed the way the kubelet would.
    container = children.deployment["spec"]["template"]["spec"]["containers"][0]
    serve, serve_env = localize(container, mounts, secrets)
    ready = f"http://127.0.0.1:{port}{container['readinessProbe']['httpGet']['path']}"
    with running(serve, ready, env=serve_env, log=tmp_path / "server.log") as proc:
        assert http_get(f"http://127.0.0.1:{port}{container['livenessProbe']['httpGet']['path']}")[0] == 200
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test")
        model = workload.served_model_name(body["spec"])
        assert [m.id for m in client.models.list().data] == [model]
        # Greedy: an unseeded sample at OpenAI's default temperature can be an immediate end of text.
        reply = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                               messages=[{"role": "user", "content": "def fibonacci(n):"}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong").models.list()

        # SIGTERM after the preStop pause: the server drains and exits within the grace period.
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once shut down: -SIGTERM is a clean exit here
        assert proc.wait(timeout=body["spec"]["server"]["terminationGracePeriodSeconds"]) in (0, -signal.SIGTERM)
        assert time.monotonic() - started < 20
    log = (tmp_path / "server.log").read_text()
    assert "Application shutdown complete" in log and "drafting from 2048 of 8192 tokens" in log
    assert "drafting in fp8 (--draft-quantization)" in log
