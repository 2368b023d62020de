"""Prefix caching as a client sees it: a prompt that repeats another's prefix reports its cached tokens in
`usage.prompt_tokens_details`, answers what it answers uncached, and the prefix cache's counters move by exactly
those tokens; a different `cache_salt` never hits another salt's prefix."""

from __future__ import annotations

from servers import metric

PREFIX = [(7 * i) % 900 + 40 for i in range(70)]  # four full blocks of 16 and a bit


def complete(server, prompt: list[int], **extra) -> dict:
    body = {"model": server.model(), "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            **extra}
    r = server.http.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_repeated_prefix_is_served_from_the_cache_with_the_same_output(server):
    before = {name: metric(server, name) for name in ("vllm:prefix_cache_queries_total",
                                                      "vllm:prefix_cache_hits_total")}
    salt = "test-a-repeated-prefix"  # no other test's requests share it
    first = complete(server, [*PREFIX, 11], cache_salt=salt)
    second = complete(server, [*PREFIX, 12], cache_salt=salt)
    other = complete(server, [*PREFIX, 12], cache_salt=salt + "-other")
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second, other)]
    assert cached == [0, 64, 0]
    assert second["choices"][0]["text"] == other["choices"][0]["text"]
    assert metric(server, "vllm:prefix_cache_queries_total") - before["vllm:prefix_cache_queries_total"] == 3 * 71
    assert metric(server, "vllm:prefix_cache_hits_total") - before["vllm:prefix_cache_hits_total"] == 64


def test_an_empty_cache_salt_is_refused(server):
    r = server.http.post(f"{server.url}/v1/completions",
                         json={"model": server.model(), "prompt": "x", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
