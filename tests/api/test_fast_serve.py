"""`ddtree serve --fast`: greedy requests on the fast path answer exactly what the reference path does;
seeded sampled requests are reproducible."""

from __future__ import annotations

import pytest
from servers import start_server

PROMPTS = ["def merge(", "class Parser:", "import os\n\ndef main("]


def test_fast_server_matches_the_reference_server(server, logs):
    fast = start_server(logs, "--fast", "--default-temperature", "0", name="fast")
    try:
        assert "fast path warmed up" in fast.log.read_text()  # before /ready said yes
        for prompt in PROMPTS:
            kw = {"prompt": prompt, "max_tokens": 32, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
            reference = server.client().completions.create(model=server.model(), temperature=0, **kw)
            fast_reply = fast.client().completions.create(model=fast.model(), **kw)  # greedy by the server default
            assert fast_reply.choices[0].token_ids == reference.choices[0].token_ids
            assert fast_reply.choices[0].text == reference.choices[0].text
        penalized = {"prompt": PROMPTS[1], "max_tokens": 32, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                     "logit_bias": {"13": 5}, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.3}}
        reference = server.client().completions.create(model=server.model(), temperature=0, **penalized)
        assert fast.client().completions.create(model=fast.model(), **penalized).choices[0].text == (
            reference.choices[0].text)
        scored = {"prompt": PROMPTS[2], "max_tokens": 16, "logprobs": 2, "extra_body": {"ignore_eos": True}}
        want = server.client().completions.create(model=server.model(), temperature=0, **scored).choices[0].logprobs
        got = fast.client().completions.create(model=fast.model(), **scored).choices[0].logprobs
        assert got.tokens == want.tokens and got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-5)
        assert [list(top) for top in got.top_logprobs] == [list(top) for top in want.top_logprobs]
        echoed = {**scored, "echo": True}  # the prompt scored too (prompt logprobs: also on the fast path)
        want = server.client().completions.create(model=server.model(), temperature=0, **echoed).choices[0].logprobs
        got = fast.client().completions.create(model=fast.model(), **echoed).choices[0].logprobs
        assert got.tokens == want.tokens and got.token_logprobs[0] is None is want.token_logprobs[0]
        assert got.token_logprobs[1:] == pytest.approx(want.token_logprobs[1:], abs=1e-5)
        assert [list(top or {}) for top in got.top_logprobs] == [list(top or {}) for top in want.top_logprobs]
        sampled = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.9, "seed": 7,
                   "extra_body": {"ignore_eos": True}}
        replies = [fast.client().completions.create(model=fast.model(), **sampled) for _ in range(2)]
        assert replies[0].choices[0].text == replies[1].choices[0].text  # a seed fixes a sampled reply
        assert replies[0].usage.completion_tokens == 24
    finally:
        fast.stop()
