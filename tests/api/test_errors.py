"""Everything a client can get wrong comes back as the OpenAI error envelope, and the server keeps serving."""

from __future__ import annotations

import openai
import pytest

MSG = [{"role": "user", "content": "Say hi."}]


def cases(name: str) -> list:
    """(path, body, status, param) with `MODEL` standing for the served model id."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    long_ids = list(range(1, 60)) * 40
    return [
        (chat, b"{not json", 400, None),
        (chat, b"[1, 2]", 400, None),
        (chat, {"model": name}, 400, "messages"),
        (chat, {"model": name, "messages": []}, 400, "messages"),
        (chat, {"model": name, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
        (chat, {"model": name, "messages": MSG, "temperature": -1}, 400, "temperature"),
        (chat, {"model": name, "messages": MSG, "temperature": "hot"}, 400, "temperature"),
        (chat, {"model": name, "messages": MSG, "top_p": 0}, 400, "top_p"),
        (chat, {"model": name, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
        (chat, {"model": name, "messages": MSG, "n": 0}, 400, "n"),
        (chat, {"model": name, "messages": MSG, "n": 129}, 400, "n"),
        (chat, {"model": name, "messages": MSG, "stop": 5}, 400, "stop"),
        (chat, {"model": name, "messages": MSG, "stream": "maybe"}, 400, "stream"),
        (chat, {"model": name, "messages": MSG, "seed": 2**70}, 400, "seed"),
        (chat, {"model": name, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
        (chat, {"model": name, "messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
        (chat, {"model": name, "messages": MSG, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
        (chat, {"model": name, "messages": MSG, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (chat, {"model": name, "messages": MSG, "logit_bias": {"five": 10}}, 400, "logit_bias"),
        (chat, {"model": name, "messages": MSG, "logit_bias": {"--5": 1}}, 400, "logit_bias"),
        (chat, {"model": name, "messages": MSG, "logit_bias": {"-5": 1}}, 400, "logit_bias"),
        (chat, {"model": name, "messages": MSG, "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
        (chat, {"model": name, "messages": MSG, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        (chat, {"model": name, "messages": MSG, "response_format": {"type": "json_schema"}}, 400,
         "response_format"),
        (chat, {"model": name, "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0"),
        (chat, {"model": name, "messages": MSG, "tools": [TOOL]}, 400, "tools"),  # no <tool_call> in the template
        (chat, {"model": name, "messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),  # nothing to call
        (chat, {"model": name, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages.0.content"),
        (chat, {"model": name, "messages": MSG, "max_tokens": 10**6}, 400, "max_tokens"),
        (chat, {"model": name, "messages": MSG, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
        (chat, {"model": "no-such-model", "messages": MSG}, 404, "model"),
        (comp, {"model": name}, 400, "prompt"),
        (comp, {"model": name, "prompt": ""}, 400, "prompt"),
        (comp, {"model": name, "prompt": [10**9]}, 400, "prompt"),
        (comp, {"model": name, "prompt": ["a", "b"]}, 400, "prompt"),
        (comp, {"model": name, "prompt": long_ids}, 400, "prompt"),
        (comp, {"model": name, "prompt": "x = 1", "suffix": "y"}, 400, "suffix"),
        (comp, {"model": name, "prompt": "x = 1", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
        (comp, {"model": name, "prompt": "x = 1", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
        (comp, {"model": name, "prompt": "x = 1", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        (comp, {"model": name, "prompt": "x = 1", "best_of": 3}, 400, "best_of"),
        (comp, {"model": "no-such-model", "prompt": "x = 1"}, 404, "model"),
    ]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def model_name(server) -> str:
    return server.http.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def test_every_bad_request_gets_its_openai_error(server):
    for path, body, status, param in cases(model_name(server)):
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
            "json": body}
        r = server.http.post(f"{server.url}{path}", **kw)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], body
        assert error["param"] == param, (body, error)
    # ... and the server is still serving.
    ok = server.http.post(f"{server.url}/v1/completions", json={"prompt": "x = 1", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_body_without_json_content_type_says_so(server):
    r = server.http.post(f"{server.url}/v1/completions", content=b'{"prompt": "x = 1"}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_unknown_model_is_404_through_the_sdk(server):
    with pytest.raises(openai.NotFoundError) as err:
        server.client().chat.completions.create(model="nope", messages=MSG)
    assert "The model `nope` does not exist." in str(err.value)


def test_context_length_error_names_the_limit(server):
    limit = server.http.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    r = server.http.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": limit})
    assert r.status_code == 400 and f"maximum context length is {limit} tokens" in r.json()["error"]["message"]
    r = server.http.post(f"{server.url}/v1/completions", json={"prompt": [1, 2] * (limit // 2 - 1), "max_tokens": 2})
    assert r.status_code == 200  # exactly at the limit is fine


def test_unknown_fields_are_ignored(server):
    r = server.http.post(f"{server.url}/v1/completions",
                   json={"prompt": "x = 1", "max_tokens": 2, "some_future_field": {"x": 1}})
    assert r.status_code == 200


def test_unknown_route_and_wrong_method_use_the_envelope(server):
    r = server.http.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = server.http.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_is_required_on_v1_and_the_tokenizer_utilities_only(guarded_server):
    url = guarded_server.url
    r = guarded_server.http.get(f"{url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert guarded_server.http.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    # A bad body without a key is refused for the key, not parsed.
    assert guarded_server.http.post(f"{url}/v1/chat/completions", content=b"{oops").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert guarded_server.client().models.list().data
    assert guarded_server.http.get(f"{url}/health").status_code == 200
    assert guarded_server.http.get(f"{url}/metrics").status_code == 200
    assert guarded_server.http.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert guarded_server.http.post(f"{url}/detokenize", json={"tokens": [1]}).status_code == 401


FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids", "stream",
          "stream_options", "logprobs", "ignore_eos", "user", "logit_bias", "include_stop_str_in_output",
          "return_token_ids", "return_spec_stats", "frequency_penalty"]
ODD_VALUES = [None, "x", -1, 10**12, [], {"a": [1]}]


@pytest.mark.slow
def test_no_odd_field_value_breaks_the_server(server):
    """Every field gets values of the wrong type or range: the answer is a result or a 400, never a 500."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "top_logprobs": None,
            "max_completion_tokens": None, "chat_template_kwargs": None, "response_format": None, "tools": None}
    bases = [("/v1/completions", {"prompt": "x", "max_tokens": 1, "echo": False, "suffix": None}),
             ("/v1/chat/completions", chat)]
    for path, base in bases:
        for name in [*FIELDS, *(k for k in base if k not in FIELDS)]:
            for value in ODD_VALUES:
                if value is None and name.startswith("max_"):
                    continue  # a valid "no limit": decoding up to the context length is just slow
                r = server.http.post(f"{server.url}{path}", json={**base, name: value})
                assert r.status_code in (200, 400, 404), (path, name, value, r.text)
                if r.status_code != 200:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert server.http.get(f"{server.url}/ready").status_code == 200
