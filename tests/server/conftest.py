"""Real `ddtree serve` processes on free loopback ports, started once per test session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny import EOS_ID, MASK_ID, make_draft, make_target

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

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, keyed by (name, sorted labels), parsed by prometheus-client."""
        text = httpx.get(f"{self.url}/metrics").text
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


def start_server(log_dir: Path, *args: str, env: dict[str, str] | None = None, api_key: str = "unused",
                 name: str = "server") -> Server:
    """`python -m ddtree.cli serve ARGS` on a free port, once /ready answers 200."""
    port = free_port()
    log = log_dir / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ddtree.cli", "serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(f"http://127.0.0.1:{port}", proc, log, api_key)
    deadline = time.monotonic() + 120
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
    raise RuntimeError(f"server not ready after 120 s:\n{log.read_text()}")


def save_word_tokenizer(target: Path) -> None:
    """A word-level tokenizer with a chat template for the tiny random target (ids match tiny.VOCAB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(90)}
    vocab.update({"<system>": 90, "<user>": 91, "<assistant>": 92, "<tool>": 93, "<|endoftext|>": EOS_ID,
                  "<|MASK|>": MASK_ID})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="w0")
    fast.chat_template = ("{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
                          "{% if add_generation_prompt %}<assistant> {% endif %}")
    fast.save_pretrained(target)


@pytest.fixture(scope="session")
def model_args(tmp_path_factory) -> tuple[str, ...]:
    """`--target/--draft` of a tiny random pair with a tokenizer."""
    root = tmp_path_factory.mktemp("model")
    make_target(root / "target")
    save_word_tokenizer(root / "target")
    make_draft(root / "draft")
    return ("--target", str(root / "target"), "--draft", str(root / "draft"))


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def server(logs, model_args) -> Iterator[Server]:
    srv = start_server(logs, *model_args, "--max-queue", "64", name="main")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def guarded_server(logs, model_args) -> Iterator[Server]:
    """A one-slot queue behind an API key (from the environment), for overload and auth tests."""
    srv = start_server(logs, *model_args, "--max-queue", "1", env={"DDTREE_API_KEY": API_KEY}, api_key=API_KEY,
                       name="guarded")
    yield srv
    srv.stop()
