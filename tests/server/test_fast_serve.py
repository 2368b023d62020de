"""`ddtree serve --fast`: greedy requests on the fast path answer exactly what the reference path does."""

from __future__ import annotations

from conftest import start_server

PROMPTS = ["def merge(", "class Parser:", "import os\n\ndef main("]


def test_fast_server_matches_the_reference_server(server, logs):
    fast = start_server(logs, "--fast", "--default-temperature", "0", name="fast")
    try:
        for prompt in PROMPTS:
            kw = {"prompt": prompt, "max_tokens": 32, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
            reference = server.client().completions.create(model=server.model(), temperature=0, **kw)
            fast_reply = fast.client().completions.create(model=fast.model(), **kw)  # greedy by the server default
            assert fast_reply.choices[0].token_ids == reference.choices[0].token_ids
            assert fast_reply.choices[0].text == reference.choices[0].text
    finally:
        fast.stop()
