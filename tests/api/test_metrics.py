"""/metrics parses as Prometheus text, and its counters move by exactly what the requests did."""

from __future__ import annotations

import json

import pytest

VLLM_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "ddtree_spec_accepted_length_bucket", "ddtree_round_seconds_bucket", "ddtree_tree_nodes_bucket",
    "ddtree_request_tokens_per_second_bucket", "ddtree_inter_token_latency_seconds_bucket",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
]


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))


def test_series_exist_with_model_label_and_fine_buckets(server):
    samples = server.metrics()
    name = server.model()
    names = {n for n, _ in samples}
    assert not [s for s in VLLM_SERIES if s not in names]
    assert all(dict(lab).get("model_name") == name for n, lab in samples if n.startswith(("vllm:", "ddtree_")))
    itl_bounds = {dict(lab)["le"] for n, lab in samples if n == "vllm:inter_token_latency_seconds_bucket"}
    assert {"0.001", "0.002", "0.005"} <= itl_bounds  # 1-5 ms tokens land in distinct buckets
    accepted_bounds = {dict(lab)["le"] for n, lab in samples if n == "ddtree_spec_accepted_length_bucket"}
    phases = {dict(lab)["phase"] for n, lab in samples if n == "ddtree_round_seconds_bucket"}
    assert {"1.0", "2.0", "3.0"} <= accepted_bounds and {"draft", "tree_build", "verify", "commit"} <= phases


def stream_usage_and_spec(server, body: dict) -> tuple[dict, dict, str]:
    with server.http.stream("POST", f"{server.url}/v1/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finish = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
    return events[-1]["usage"], finish["metrics"]["speculative_decoding"], finish["choices"][0]["finish_reason"]


@pytest.mark.slow
def test_counters_move_by_exactly_what_the_requests_did(server):
    before = server.metrics()
    extra = {"model": server.model(), "return_spec_stats": True, "ignore_eos": True, "temperature": 0}
    done = []  # (usage, spec, finish_reason)
    messages = [{"role": "user", "content": "Write a function."}]
    url = server.url
    r = server.http.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 14, **extra}).json()
    done.append((r["usage"], r["metrics"]["speculative_decoding"], r["choices"][0]["finish_reason"]))
    done.append(stream_usage_and_spec(server, {"prompt": "import sys", "max_tokens": 9, **extra}))
    text = server.http.post(f"{url}/v1/completions", json={"prompt": "class Node:", "max_tokens": 12, **extra}).json()
    middle = len(text["choices"][0]["text"]) // 2
    stop = text["choices"][0]["text"][middle:middle + 3]  # the stop request ends early, with "stop"
    r = server.http.post(f"{server.url}/v1/completions",
                   json={"prompt": "class Node:", "max_tokens": 12, "stop": [stop], **extra}).json()
    done.append((text["usage"], text["metrics"]["speculative_decoding"], text["choices"][0]["finish_reason"]))
    done.append((r["usage"], r["metrics"]["speculative_decoding"], r["choices"][0]["finish_reason"]))
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u, _, _ in done)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u, _, _ in done)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:spec_decode_num_drafts_total") == sum(s["num_verify_rounds"] for _, s, _ in done)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for _, s, _ in done)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for _, s, _ in done)
    # Position 0 counts rounds that accepted at least one draft token.
    assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == sum(
        sum(s["accepted_length_histogram"][1:]) for _, s, _ in done)
    assert delta("ddtree_spec_accepted_length_count") == sum(s["num_verify_rounds"] for _, s, _ in done)
    for histogram in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                      "vllm:request_queue_time_seconds_count", "vllm:request_generation_tokens_count"):
        assert delta(histogram) == len(done), histogram
    assert delta("vllm:request_generation_tokens_sum") == sum(u["completion_tokens"] for u, _, _ in done)
