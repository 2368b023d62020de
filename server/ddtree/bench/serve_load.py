"""`ddtree bench-serve`: a load generator for a running OpenAI-compatible server, over HTTP only.

It speaks nothing but the public API (so it measures ddtree, vLLM or SGLang alike, as `vllm bench serve`
does): N prompts go out at a request rate (Poisson arrivals; inf: all at once) with at most C in flight, every
request streamed (SSE), and each one timed on the client: TTFT (to the first chunk with text), ITL (between
chunks with text: one chunk per verify round on ddtree, so a chunk may carry several tokens), TPOT ((E2E - TTFT)
/ (output tokens - 1)) and E2E. Output tokens come from the stream's `usage` (stream_options.include_usage),
or the count of text chunks when a server sends none. Where the server exposes Prometheus `/metrics` with
vLLM's spec-decode counters, the run's mean acceptance length is 1 + accepted / drafts between a scrape
before and one after each level (as `vllm bench serve` computes it; other traffic in the window counts too),
and likewise the prefix cache's hit rate (vLLM's prefix_cache_queries / hits counters).

`--dataset shared-prefix` measures prefix caching: every prompt is one common prefix of --prefix-len random words
(a system prompt) and a user turn of --input-len words of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddtree.bench.http_client import HTTP_ERRORS, Client
from ddtree.errors import DDTreeError

# vLLM's spec-decode counters (ddtree's server exposes them under the same names: api/metrics.py).
SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}
PREFIX_COUNTERS = {"queries": "vllm:prefix_cache_queries_total", "hits": "vllm:prefix_cache_hits_total"}
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PERCENTILES = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))
LATENCIES = ("ttft", "tpot", "itl", "e2e")
MAX_ERRORS_SHOWN = 3
# Words for the random dataset: common English and code words, most of them one token in BPE vocabularies,
# so a prompt of --input-len words is about --input-len tokens (the server's usage reports the exact count).
WORDS = (
    "the", "of", "and", "to", "in", "is", "for", "that", "with", "as", "on", "by", "this", "from", "import",
    "def", "return", "class", "self", "if", "else", "not", "none", "true", "false", "value", "list", "data",
    "file", "name", "line", "time", "new", "int", "str", "print", "result", "error", "test", "type", "code",
    "user", "model", "path", "key", "item", "text", "number", "first", "last", "next", "index", "count", "size",
    "start", "end", "open", "read", "write", "function", "object", "string", "array", "table", "query", "server",
    "client", "request", "response", "token", "batch", "tree", "node"
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class Prompt:
    """One request's input: a completions prompt or chat messages, and its max_tokens if the dataset set one."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None


@dataclass
class RequestResult:
    """What the client saw of one request (seconds; lists empty and None when it failed before any text)."""

    ok: bool
    output_tokens: int = 0
    prompt_tokens: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# --------------------------------------------------------------------------------------------------------
# Datasets


def shared_prefix_prompts(count: int, prefix_len: int, input_len: int, seed: int = 0) -> list[Prompt]:
    """`count` prompts of one common prefix of `prefix_len` random words, each followed by its own `input_len`
    random words (a numbered turn, so no two share more than the prefix)."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
    return [Prompt(prompt=f"{prefix}\n{i}: " + " ".join(rng.choice(WORDS) for _ in range(input_len)))
            for i in range(count)]


def load_prompts(args: argparse.Namespace, level: int = 0) -> list[Prompt]:
    """--num-prompts prompts: random words of --input-len, a shared prefix of --prefix-len words before each such
    turn, or a JSONL file's lines (cycled when too few). The generated datasets draw new prompts (and a new shared
    prefix) for each concurrency level (`level`: its index), so no level finds the one before it in the server's
    prefix cache; a file's prompts are the same at every level."""
    seed = args.seed + level
    if args.dataset == "random":
        rng = random.Random(seed)
        return [Prompt(prompt=" ".join(rng.choice(WORDS) for _ in range(args.input_len)))
                for _ in range(args.num_prompts)]
    if args.dataset == "shared-prefix":
        return shared_prefix_prompts(args.num_prompts, args.prefix_len, args.input_len, seed)
    path = Path(args.dataset)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise DDTreeError(f"--dataset: cannot read {path}: {exc.strerror}") from None
    pool = [_parse_line(line, number, path, args.endpoint) for number, line in enumerate(lines, 1)]
    if not pool:
        raise DDTreeError(f"--dataset {path} holds no prompts")
    return [pool[i % len(pool)] for i in range(args.num_prompts)]


def _parse_line(line: str, number: int, path: Path, endpoint: str) -> Prompt:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DDTreeError(f"{where} is not JSON: {exc}") from None
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise DDTreeError(f'{where}: expected an object with "prompt" or "messages"')
    max_tokens = row.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise DDTreeError(f"{where}: max_tokens must be a positive integer")
    if "messages" in row:
        if endpoint != "chat":
            raise DDTreeError(f'{where} has "messages": run it with --endpoint chat')
        if not isinstance(row["messages"], list):
            raise DDTreeError(f'{where}: "messages" must be a list')
        return Prompt(messages=row["messages"], max_tokens=max_tokens)
    if not isinstance(row["prompt"], str):
        raise DDTreeError(f'{where}: "prompt" must be a string')
    return Prompt(prompt=row["prompt"], max_tokens=max_tokens)


def request_body(prompt: Prompt, args: argparse.Namespace, model: str) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens or args.max_tokens,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = prompt.messages or [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; ddtree's server takes it too
    return body


# --------------------------------------------------------------------------------------------------------
# One streamed request


async def stream_request(client: Client, path: str, body: dict, headers: dict[str, str],
                         timeout: float | None = None) -> RequestResult:
    """Send one streaming request and time its chunks; any failure (HTTP status, error event, broken stream, more
    than `timeout` seconds) becomes a failed result with a one-line reason."""
    start = time.perf_counter()
    first = last = done = None
    itl: list[float] = []
    chunks = 0
    usage: dict | None = None
    try:
        async with asyncio.timeout(timeout), client.request("POST", path, body, headers) as response:
            if response.status != 200:
                return RequestResult(ok=False, error=_http_error(response.status, await response.read()))
            async for line in response.lines():  # to the body's end, so the connection serves the next request
                if done is not None or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = time.perf_counter()
                    continue
                event = json.loads(data)
                if not isinstance(event, dict):
                    return RequestResult(ok=False, error=f"not an event: {data[:200]}")
                if "error" in event:
                    return RequestResult(ok=False, error=f"error event: {_message(event)}")
                usage = event.get("usage") or usage
                if any(_text(choice) for choice in event.get("choices") or ()):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except TimeoutError:
        return RequestResult(ok=False, error=f"no reply within {timeout:g} s")
    except HTTP_ERRORS as exc:  # ValueError: a data line that is not JSON
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    end = time.perf_counter() if done is None else done
    tokens = usage.get("completion_tokens") if usage else None
    return RequestResult(ok=True, output_tokens=chunks if tokens is None else tokens,
                         prompt_tokens=usage.get("prompt_tokens") if usage else None,
                         ttft=None if first is None else first - start, e2e=end - start, itl=itl)


def _text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    return choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""


def _message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else payload)


def _http_error(status: int, raw: bytes) -> str:
    try:
        detail = _message(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
        detail = raw.decode("utf-8", "replace").strip()[:200]
    return f"HTTP {status}: {detail}" if detail else f"HTTP {status}"


# --------------------------------------------------------------------------------------------------------
# /metrics


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> each series' value summed over its label sets (a few lines: no client library)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            try:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
            except ValueError:
                continue
    return out


async def scrape(client: Client, headers: dict[str, str]) -> dict[str, float] | None:
    """The spec-decode and prefix-cache counters the server has now, or None without /metrics."""
    try:
        status, raw = await client.get("/metrics", headers=headers)
    except HTTP_ERRORS:
        return None
    if status != 200:
        return None
    counters = parse_counters(raw.decode("utf-8", "replace"))
    return {key: counters[name] for key, name in (SPEC_COUNTERS | PREFIX_COUNTERS).items() if name in counters}


def _growth(before: dict[str, float] | None, after: dict[str, float] | None, keys) -> dict[str, float] | None:
    """Each counter's growth over a run, or None when the server lacks any of them."""
    if before is None or after is None or not all(key in before and key in after for key in keys):
        return None
    return {key: after[key] - before[key] for key in keys}


def prefix_cache(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """Prompt tokens looked up in and found in the prefix cache over a run, and their ratio (None without)."""
    delta = _growth(before, after, PREFIX_COUNTERS)
    if delta is None or delta["queries"] <= 0:
        return None
    return {"queries": int(delta["queries"]), "hits": int(delta["hits"]),
            "hit_rate": delta["hits"] / delta["queries"]}


def spec_decode(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """The counters' growth over a run and its mean acceptance length (None without speculation)."""
    delta = _growth(before, after, SPEC_COUNTERS)
    if delta is None or delta["drafts"] <= 0:
        return None
    return {**{key: int(value) for key, value in delta.items()},
            "acceptance_length": 1.0 + delta["accepted_tokens"] / delta["drafts"]}


# --------------------------------------------------------------------------------------------------------
# A run at one concurrency


class Progress:
    """A line on stderr each time another tenth of the run's requests has completed."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.done = self.failed = self.shown = 0

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        tenth = self.done * 10 // self.total
        if tenth > self.shown:
            self.shown = tenth
            print(f"ddtree bench-serve: {self.label}: {self.done}/{self.total} done ({tenth * 10}%), "
                  f"{self.failed} failed", file=sys.stderr, flush=True)


async def run_level(client: Client, args: argparse.Namespace, path: str, bodies: list[dict],
                    headers: dict[str, str], concurrency: int | None) -> dict:
    """Send every body at the request rate with at most `concurrency` in flight; the level's summary."""
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(concurrency or len(bodies))
    label = f"concurrency {concurrency}" if concurrency else "unbounded concurrency"
    progress = Progress(label, len(bodies))

    async def one(body: dict) -> RequestResult:
        async with limit:
            result = await stream_request(client, path, body, headers, args.timeout)
        progress.update(result)
        return result

    before = await scrape(client, headers)
    start = time.perf_counter()
    tasks = []
    for index, body in enumerate(bodies):
        if index and math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
        tasks.append(asyncio.create_task(one(body)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    after = await scrape(client, headers)
    return summarize(results, duration, concurrency, spec_decode(before, after), prefix_cache(before, after))


def _stats(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (linear interpolation, as numpy and vLLM compute them)."""
    if not values:
        return {name: None for name, _ in PERCENTILES}
    ms = np.asarray(values) * 1000.0
    return {name: float(ms.mean() if q is None else np.percentile(ms, q)) for name, q in PERCENTILES}


def summarize(results: list[RequestResult], duration: float, concurrency: int | None,
              spec: dict | None, cache: dict | None = None) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    latencies = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
                 "itl": [gap for r in ok for gap in r.itl], "e2e": [r.e2e for r in ok]}
    errors = [r.error for r in results if not r.ok]
    return {"concurrency": concurrency, "completed": len(ok), "failed": len(errors),
            "errors": errors[:MAX_ERRORS_SHOWN], "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_throughput": output / duration,
            "total_token_throughput": (prompt + output) / duration, "total_input_tokens": prompt,
            "total_output_tokens": output,
            **{f"{name}_ms": _stats(values) for name, values in latencies.items()},
            "acceptance_length": spec["acceptance_length"] if spec else None, "spec_decode": spec,
            "prefix_cache": cache,
            "requests": [{**asdict(r), "tpot": r.tpot} for r in results]}


# --------------------------------------------------------------------------------------------------------
# The command


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(report: dict) -> str:
    """One column per concurrency level, one row per figure; then the first errors of each level."""
    runs = report["runs"]
    rows: list[tuple[str, list[str]]] = [
        ("concurrency", [str(r["concurrency"] or "all") for r in runs]),
        ("requests ok / failed", [f"{r['completed']} / {r['failed']}" for r in runs]),
        ("duration (s)", [_fmt(r["duration_s"]) for r in runs]),
        ("requests/s", [_fmt(r["request_throughput"]) for r in runs]),
        ("output tok/s", [_fmt(r["output_throughput"], 1) for r in runs]),
        ("total tok/s", [_fmt(r["total_token_throughput"], 1) for r in runs]),
        ("output tokens", [str(r["total_output_tokens"]) for r in runs]),
    ]
    for name in LATENCIES:
        for stat, _ in PERCENTILES:
            rows.append((f"{name.upper()} {stat} (ms)", [_fmt(r[f"{name}_ms"][stat]) for r in runs]))
    rows.append(("acceptance length", [_fmt(r["acceptance_length"]) for r in runs]))
    rows.append(("prefix cache hit rate", [_fmt(r["prefix_cache"] and r["prefix_cache"]["hit_rate"], 3)
                                           for r in runs]))
    width = max(len(label) for label, _ in rows)
    cols = [max(len(row[1][i]) for row in rows) for i in range(len(runs))]
    title = (f"{report['model']} at {report['base_url']}{ENDPOINTS[report['endpoint']]}: "
             f"{report['num_prompts']} prompts a level, request rate {report['request_rate']}")
    lines = [title, "-" * len(title)]
    lines += [f"{label:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(values, cols, strict=True))
              for label, values in rows]
    for r in runs:
        for error in r["errors"]:
            lines.append(f"error at concurrency {r['concurrency'] or 'all'}: {error}")
    return "\n".join(lines)


async def _model(client: Client, base_url: str, headers: dict[str, str], given: str | None) -> str:
    """The model to ask for (the first of /v1/models unless given); an unreachable server is a user error."""
    try:
        status, raw = await client.get("/v1/models", headers=headers)
    except (*HTTP_ERRORS, TimeoutError) as exc:
        raise DDTreeError(f"cannot reach {base_url}: {exc or type(exc).__name__}") from None
    if given:
        return given  # even with a refused key: the requests then fail and are counted as such
    if status != 200:
        raise DDTreeError(f"GET {base_url}/v1/models: {_http_error(status, raw)}")
    try:
        return json.loads(raw)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise DDTreeError(f"GET {base_url}/v1/models lists no model; pass --model") from None


async def _bench(args: argparse.Namespace) -> dict:
    key = args.api_key or os.environ.get("DDTREE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    levels = args.concurrency or [None]
    prompts = [load_prompts(args, level) for level in range(len(levels))]  # a bad dataset fails before any request
    try:
        client = Client(args.base_url)
    except ValueError as exc:
        raise DDTreeError(f"--base-url: {exc}") from None
    async with client:
        model = await _model(client, args.base_url, headers, args.model)
        runs = []
        for level, concurrency in enumerate(levels):
            bodies = [request_body(p, args, model) for p in prompts[level]]
            runs.append(await run_level(client, args, ENDPOINTS[args.endpoint], bodies, headers, concurrency))
    return {"base_url": args.base_url, "model": model, "endpoint": args.endpoint, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "dataset": args.dataset, "runs": runs}


def bench_serve(args: argparse.Namespace) -> int:
    """Run every level, print the table, write --json; exit 1 when any request failed."""
    if args.num_prompts < 1:
        raise DDTreeError("--num-prompts must be at least 1")
    if args.concurrency and min(args.concurrency) < 1:
        raise DDTreeError("--concurrency levels must be at least 1")
    if not args.request_rate > 0:
        raise DDTreeError("--request-rate must be above 0 (inf: every request at once)")
    if args.max_tokens < 1 or args.input_len < 1 or args.prefix_len < 1:
        raise DDTreeError("--max-tokens, --input-len and --prefix-len must be at least 1")
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    report = asyncio.run(_bench(args))
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(r["failed"] for r in report["runs"]) else 0
