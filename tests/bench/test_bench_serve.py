"""`ddtree bench-serve` against a real `ddtree serve` on the demo pair: its counts agree with the server's own
counters, a refused request is counted and shown, and an unreachable server is a one-line error."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
from api.servers import API_KEY, Server, free_port, start_server
from ddtree.cli import main

REPORT_KEYS = {"base_url", "model", "endpoint", "num_prompts", "request_rate", "max_tokens", "temperature",
               "dataset", "runs"}
RUN_KEYS = {"concurrency", "completed", "failed", "errors", "duration_s", "request_throughput", "output_throughput",
            "total_token_throughput", "total_input_tokens", "total_output_tokens", "ttft_ms", "tpot_ms", "itl_ms",
            "e2e_ms", "acceptance_length", "spec_decode", "prefix_cache", "requests"}
SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("bench-serve"), "--api-key", API_KEY, api_key=API_KEY,
                       name="bench-serve")
    yield srv
    srv.stop()


def total(server: Server, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in server.metrics().items()
               if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))


def test_the_report_agrees_with_the_servers_counters(server, tmp_path, capsys):
    out = tmp_path / "report.json"
    before = {name: total(server, name) for name in (*SPEC, "vllm:generation_tokens_total")}
    ok_before = total(server, "vllm:request_success_total", finished_reason="length")
    rc = main(["bench-serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "3",
               "--concurrency", "1", "3", "--max-tokens", "5", "--input-len", "6", "--ignore-eos", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS and report["model"] == server.model()
    runs = report["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    for run in runs:
        assert set(run) == RUN_KEYS
        assert (run["completed"], run["failed"], run["errors"]) == (3, 0, [])
        assert run["total_output_tokens"] == sum(r["output_tokens"] for r in run["requests"]) == 3 * 5
        assert run["total_input_tokens"] == sum(r["prompt_tokens"] for r in run["requests"])
        for latency in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = run[latency]
            assert 0 < stats["median"] <= stats["p90"] <= stats["p99"], latency
        assert all(r["ttft"] <= r["e2e"] for r in run["requests"])
        spec = run["spec_decode"]
        assert run["acceptance_length"] == 1 + spec["accepted_tokens"] / spec["drafts"]
    # The server counted the same requests, tokens and verify rounds.
    assert total(server, "vllm:request_success_total", finished_reason="length") - ok_before == 6
    assert total(server, "vllm:generation_tokens_total") - before["vllm:generation_tokens_total"] == 6 * 5
    assert total(server, SPEC[0]) - before[SPEC[0]] == sum(r["spec_decode"]["drafts"] for r in runs)
    assert total(server, SPEC[1]) - before[SPEC[1]] == sum(r["spec_decode"]["accepted_tokens"] for r in runs)
    printed = capsys.readouterr()
    assert "requests ok / failed" in printed.out and "3 / 0" in printed.out
    (tau_row,) = [line for line in printed.out.splitlines() if line.startswith("acceptance length")]
    assert tau_row.split()[-2:] == [f"{r['acceptance_length']:.2f}" for r in runs]
    assert "concurrency 3: 3/3 done (100%)" in printed.err


def test_a_jsonl_dataset_on_the_chat_endpoint_with_its_own_max_tokens(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "def add(a, b):", "max_tokens": 3}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Write a loop."}]}) + "\n")
    out = tmp_path / "report.json"
    rc = main(["bench-serve", "--base-url", server.url + "/v1", "--api-key", API_KEY, "--endpoint", "chat",
               "--dataset", str(data), "--num-prompts", "3", "--max-tokens", "5", "--ignore-eos",
               "--request-rate", "20", "--json", str(out)])
    assert rc == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["concurrency"] is None and run["completed"] == 3
    assert [r["output_tokens"] for r in run["requests"]] == [3, 5, 3]  # the lines cycle


def test_a_shared_prefix_dataset_reports_the_servers_prefix_cache_hits(server, tmp_path, capsys):
    """Prompts of one common prefix, one at a time: all but the first find it cached, and the report's hit
    rate is the server's own counters' growth."""
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    before = {name: total(server, name) for name in names}
    out = tmp_path / "report.json"
    rc = main(["bench-serve", "--base-url", server.url, "--api-key", API_KEY, "--dataset", "shared-prefix",
               "--prefix-len", "80", "--input-len", "4", "--num-prompts", "3", "--concurrency", "1",
               "--max-tokens", "2", "--seed", "11", "--json", str(out)])
    assert rc == 0
    (run,) = json.loads(out.read_text())["runs"]
    cache = run["prefix_cache"]
    assert cache["queries"] == total(server, names[0]) - before[names[0]] == run["total_input_tokens"]
    assert cache["hits"] == total(server, names[1]) - before[names[1]] > 0
    assert cache["hit_rate"] == cache["hits"] / cache["queries"]
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prefix cache hit rate")]
    assert row.split()[-1] == f"{cache['hit_rate']:.3f}"


def test_refused_requests_are_counted_and_shown(server, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = main(["bench-serve", "--base-url", server.url, "--api-key", "wrong", "--model", server.model(),
               "--num-prompts", "3", "--max-tokens", "2", "--json", str(out)])
    assert rc == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["completed"], run["failed"], run["total_output_tokens"]) == (0, 3, 0)
    assert run["errors"][0].startswith("HTTP 401")
    assert run["ttft_ms"]["median"] is None and run["acceptance_length"] is None
    printed = capsys.readouterr().out
    assert "0 / 3" in printed and "error at concurrency all: HTTP 401" in printed
    # Without --model the key is needed to list the models: a one-line error.
    assert main(["bench-serve", "--base-url", server.url, "--api-key", "wrong"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddtree bench-serve: error: GET") and "HTTP 401" in err and "\n" not in err


def test_an_unreachable_server_is_a_one_line_error(capsys):
    rc = main(["bench-serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddtree bench-serve: error: cannot reach http://127.0.0.1:") and "\n" not in err


def test_a_messages_line_needs_the_chat_endpoint(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["bench-serve", "--dataset", str(data), "--base-url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert capsys.readouterr().err.strip() == (f'ddtree bench-serve: error: {data}:1 has "messages": run it with '
                                              "--endpoint chat")


def test_bench_serve_needs_no_http_library(server, monkeypatch, tmp_path):
    """bench-serve speaks HTTP with the standard library alone: it runs where ddtree is installed without the
    server extra (no httpx)."""
    monkeypatch.setitem(sys.modules, "httpx", None)
    for name in ("ddtree.bench.serve_load", "ddtree.bench.http_client"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    out = tmp_path / "report.json"
    assert main(["bench-serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "1",
                 "--max-tokens", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["runs"][0]["completed"] == 1


def test_each_concurrency_level_draws_its_own_generated_prompts(tmp_path):
    """A level must not find the one before it in the server's prefix cache: random and shared-prefix prompts (the
    shared prefix too) are new at each level, the same for the same seed; a dataset file's are the same at all."""
    import argparse

    from ddtree.bench.serve_load import load_prompts

    def prompts(dataset: str, level: int, seed: int = 0) -> list[str]:
        args = argparse.Namespace(dataset=dataset, seed=seed, input_len=6, prefix_len=20, num_prompts=4,
                                  endpoint="completions")
        return [p.prompt for p in load_prompts(args, level)]

    for dataset in ("random", "shared-prefix"):
        first, second = prompts(dataset, 0), prompts(dataset, 1)
        assert not set(first) & set(second) and first == prompts(dataset, 0)
        assert prompts(dataset, 1) == prompts(dataset, 0, seed=1)
    assert prompts("shared-prefix", 0)[0][:60] != prompts("shared-prefix", 1)[0][:60]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "a b c"}\n{"prompt": "d e"}\n')
    assert prompts(str(lines), 0) == prompts(str(lines), 3) == ["a b c", "d e", "a b c", "d e"]
