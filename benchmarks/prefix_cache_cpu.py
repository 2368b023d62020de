"""Prefix caching through `ddtree serve` with its defaults, on the CPU with the demo pair: a prompt of about
--prefix-tokens tokens answered at max_tokens 1, then another prompt that starts with the same text; each pair's
two latencies, and the second request's output against `ddtree generate` on the same text. Each pair uses its
own prefix (a different stretch of this repository's source), so every first request misses.

    PYTHONPATH=server python benchmarks/prefix_cache_cpu.py --pairs 5            # caching on (the default)
    PYTHONPATH=server python benchmarks/prefix_cache_cpu.py --pairs 5 --server-args=--no-enable-prefix-caching
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ddtree.cli", "serve", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "server")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def prefixes(url: str, count: int, tokens: int) -> list[str]:
    """`count` texts of about `tokens` tokens each, from distinct stretches of the repository's source."""
    source = "".join(p.read_text() for p in sorted((ROOT / "server" / "ddtree").rglob("*.py")))
    out, start = [], 0
    for _ in range(count):
        lo, hi = start, start + tokens * 8
        while True:  # grow or shrink to about `tokens`
            text = source[lo:hi]
            n = len(httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"])
            if abs(n - tokens) <= 8:
                break
            hi = lo + max(1, int((hi - lo) * tokens / n))
        out.append(text)
        start = hi + 1000
    return out


def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    body = {"model": "ddtree-demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return time.perf_counter() - t, reply


def generate(prompt: str, max_tokens: int) -> str:
    out = subprocess.run([sys.executable, "-m", "ddtree.cli", "generate", "--prompt", prompt, "--max-new-tokens",
                          str(max_tokens), "--temperature", "0", "--json"], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "server")})
    return json.loads(out.stdout)["text"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--prefix-tokens", type=int, default=800)
    p.add_argument("--check-tokens", type=int, default=32, help="max_tokens of the output check against generate")
    p.add_argument("--server-args", default="", help="extra `ddtree serve` flags")
    args = p.parse_args()
    proc, url = start(shlex.split(args.server_args))
    try:
        complete(url, "def warm(up):", 1)
        firsts, seconds, equal = [], [], []
        for i, prefix in enumerate(prefixes(url, args.pairs, args.prefix_tokens)):
            first, _ = complete(url, prefix + "\n# first question\n", 1)
            second_prompt = prefix + "\n# second question\n"
            second, reply = complete(url, second_prompt, 1)
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            _, longer = complete(url, second_prompt, args.check_tokens)
            same = (reply["choices"][0]["text"] == generate(second_prompt, 1)
                    and longer["choices"][0]["text"] == generate(second_prompt, args.check_tokens))
            firsts.append(first)
            seconds.append(second)
            equal.append(same)
            print(f"pair {i}: prompt {reply['usage']['prompt_tokens']} tokens ({cached} cached): first {first:.3f} s, "
                  f"second {second:.3f} s ({second / first:.2f}x); outputs equal to generate: {same}")
    finally:
        proc.terminate()
        proc.wait()
    first, second = statistics.median(firsts), statistics.median(seconds)
    print(f"median: first {first:.3f} s, second {second:.3f} s: {second / first:.3f}x; "
          f"every second output equal to generate: {all(equal)}")


if __name__ == "__main__":
    main()
