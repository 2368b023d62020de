"""Structured replies through the API: Hermes <tool_call> blocks become OpenAI `tool_calls` (streamed and not;
forced choices refused), and `response_format` JSON objects and schemas constrain decoding."""

from __future__ import annotations

import json
import re
import time

import pytest
from ddtree.api import ServerConfig, create_app
from ddtree.engine import Engine
from ddtree.replies import template_mentions
from ddtree.tools import START, ToolCallStream, split_tool_calls, template_message
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from scripted_engine import ScriptedEngine, prefill, round_

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# A small Hermes-style template of our own: tools in the system turn, calls as <tool_call> JSON blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# -- the parser -------------------------------------------------------------------------------------------


def test_blocks_become_calls_and_the_rest_stays_content():
    text = f"Let me look.\n{CALL}\n" + CALL.replace("Paris", "Oslo") + "\n"
    content, calls = split_tool_calls(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert split_tool_calls(text, parallel=False)[1][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert len(split_tool_calls(text, parallel=False)[1]) == 1


def test_text_without_well_formed_calls_is_returned_untouched():
    for text in ("  plain answer \n", "<tool_call>not json</tool_call> tail", '<tool_call>{"city": 1}</tool_call>',
                 "<tool_call>[1, 2]</tool_call>"):
        assert split_tool_calls(text) == (text, [])
    content, calls = split_tool_calls(f"<tool_call>oops</tool_call>{CALL}")
    assert content == "<tool_call>oops</tool_call>" and len(calls) == 1  # the malformed block is not lost


def test_an_unterminated_block_with_whole_json_is_a_call_and_a_cut_one_is_content():
    content, calls = split_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    cut = '<tool_call>{"name": "f", "argu'
    assert split_tool_calls(cut) == (cut, [])
    assert split_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1][0][
        "function"]["arguments"] == '{"x": 1}'  # arguments already a string stay as sent


@pytest.mark.parametrize("text", [f"Checking {CALL} done", CALL, "no calls at all <tool", f"a<tool_c{CALL}",
                                  "<tool_call>broken</tool_call>"])
def test_streaming_releases_content_early_and_ends_like_the_whole_reply(text):
    whole_calls = split_tool_calls(text)[1]
    for cut1 in range(len(text) + 1):
        for cut2 in range(cut1, len(text) + 1, 7):
            stream = ToolCallStream()
            sent = "".join(stream.feed(piece) for piece in (text[:cut1], text[cut1:cut2], text[cut2:]))
            tail, calls = stream.finish()
            start = text.find(START)
            if whole_calls:
                assert sent == text[:start]  # everything before the first block went out at once
                assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
                rest = split_tool_calls(text[start:])[0]
                assert tail == rest
            else:
                assert sent + (tail or "") == text and not calls
            assert START not in sent


def test_template_helpers():
    assert template_mentions(HERMES_TEMPLATE, START)
    assert template_mentions({"default": "x", "tool_use": HERMES_TEMPLATE}, START)
    assert not template_mentions("{{ messages }}", START) and not template_mentions(None, START)
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}
    rendered = template_message(message)
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert rendered["tool_calls"][1]["function"]["arguments"] == "not json"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request is not modified


# -- the API with a scripted engine ------------------------------------------------------------------------


class ToolEngine(ScriptedEngine):
    """A scripted engine whose tokens are text pieces of a reply with a tool call; records each chat render."""

    PIECES = ("I'll check.", "<tool_", "call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "\n</tool_call>", "Sunny.")
    vocab_size = len(PIECES)

    def __init__(self, template: str = HERMES_TEMPLATE) -> None:
        super().__init__()
        self.tokenizer = type("Tokenizer", (), {"chat_template": template})()
        self.renders: list[tuple[list[dict], dict]] = []

    def decode(self, ids: list[int]) -> str:
        return "".join(self.PIECES[i] for i in ids)

    def chat_ids(self, messages, **kwargs) -> list[int]:
        self.renders.append((messages, kwargs))
        return [0, 1]


def scripted_call_reply() -> list:
    return [prefill(0), round_([1, 2]), round_([3, 4]), round_([5], finish="stop")]


def client_for(engine: ScriptedEngine, **config) -> TestClient:
    client = TestClient(create_app(lambda: engine, ServerConfig(**config)))
    client.__enter__()
    deadline = time.monotonic() + 10
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return client


def chat(client: TestClient, **body):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Paris?"}], **body})


def test_a_reply_with_a_call_comes_back_as_tool_calls():
    engine = ToolEngine()
    engine.scripts.append(scripted_call_reply())
    with client_for(engine) as client:
        r = chat(client, tools=[WEATHER])
    assert r.status_code == 200, r.text
    reply = ChatCompletion.model_validate(r.json())  # the OpenAI SDK's own model of the response
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check."
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert engine.renders[0][1]["tools"] == [WEATHER]  # the template rendered the tools


def test_a_streamed_call_arrives_as_one_tool_call_delta_after_the_content():
    engine = ToolEngine()
    engine.scripts.append(scripted_call_reply())
    with client_for(engine) as client:
        r = chat(client, tools=[WEATHER], stream=True)
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in r.text.splitlines()
              if line.startswith("data: {")]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert content == "I'll check." and START not in content
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_reply_without_a_call_is_plain_content_and_a_call_cut_by_length_stays_text():
    engine = ToolEngine()
    engine.scripts.append([prefill(6), round_([6], finish="stop")])
    engine.scripts.append([prefill(1), round_([2, 3], finish="length")])
    with client_for(engine) as client:
        plain = chat(client, tools=[WEATHER]).json()["choices"][0]
        cut = chat(client, tools=[WEATHER]).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Sunny.Sunny."} and plain["finish_reason"] == "stop"
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"].startswith("<tool_call>")


def test_tool_choice_none_neither_renders_nor_parses_and_bad_choices_are_refused():
    engine = ToolEngine()
    engine.scripts.append(scripted_call_reply())
    with client_for(engine) as client:
        r = chat(client, tools=[WEATHER], tool_choice="none")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].count("<tool_call>") == 1
        assert "tools" not in engine.renders[0][1]
        bad = [(dict(tool_choice="sometimes"), "tool_choice"),
               (dict(tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice"),
               (dict(tool_choice={"type": "function"}), "tool_choice"),
               (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
               (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0")]
        for body, param in bad:
            r = chat(client, **{"tools": [WEATHER], **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = chat(client, tool_choice="required")
        assert r.status_code == 400 and "offers no tools" in r.json()["error"]["message"]


def test_a_template_without_tool_blocks_refuses_tools_unless_the_parser_is_forced():
    engine = ToolEngine(template="{{ messages }}")
    engine.scripts.append(scripted_call_reply())
    with client_for(engine) as client:
        r = chat(client, tools=[WEATHER])
        assert r.status_code == 400 and "--tool-call-parser hermes" in r.json()["error"]["message"]
    with client_for(engine, tool_call_parser="hermes") as client:
        assert chat(client, tools=[WEATHER]).json()["choices"][0]["finish_reason"] == "tool_calls"
    with client_for(ToolEngine(), tool_call_parser="none") as client:
        assert chat(client, tools=[WEATHER]).status_code == 400


def test_earlier_calls_and_tool_results_reach_the_template():
    engine = ToolEngine()
    engine.scripts.append([prefill(6), round_([6], finish="stop")])
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_9", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_9", "content": "sunny, 21 C"}]
    with client_for(engine) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    rendered = engine.renders[0][0]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_9"}


# -- the real tokenizer --------------------------------------------------------------------------------------


def test_the_real_chat_template_renders_tools_into_the_prompt_the_model_decodes():
    engine = Engine.from_pretrained(device="cpu")  # the demo pair, with a Hermes-style template
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with client_for(engine) as client:
        ids = client.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
        assert "get_weather" in engine.decode(ids) and "Weather in a city" in engine.decode(ids)
        r = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 8,
                                                      "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == ids  # the chat endpoint decoded from the same rendering


# -- response_format ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_client():
    with client_for(Engine.from_pretrained(device="cpu")) as client:
        yield client


def test_json_object_and_json_schema_replies_parse(demo_client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {
        "type": "string", "maxLength": 8}, "maxItems": 2}}, "required": ["ok", "tags"], "additionalProperties": False}
    formats = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}]
    for temperature in (0, 1):
        for fmt in formats:
            r = chat(demo_client, response_format=fmt, max_tokens=120, temperature=temperature, seed=1)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            value = json.loads(choice["message"]["content"])
            assert isinstance(value, dict) and choice["finish_reason"] == "stop"
            if fmt["type"] == "json_schema":
                assert set(value) == {"ok", "tags"} and isinstance(value["ok"], bool) and len(value["tags"]) <= 2
    streamed = chat(demo_client, response_format=formats[1], max_tokens=120, temperature=0, stream=True)
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in streamed.text.splitlines() if line.startswith("data: {") and '"choices":[{' in line)
    assert set(json.loads(text)) == {"ok", "tags"}


def test_vllm_structured_outputs_and_guided_fields_on_both_endpoints(demo_client):
    choices = ["alpha", "beta gamma"]
    for extra in (dict(guided_choice=choices), dict(structured_outputs={"choice": choices})):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Pick."}]}),
                           ("/v1/completions", {"prompt": "def pick():"})):
            r = demo_client.post(path, json={**body, **extra, "temperature": 1, "seed": 2, "max_tokens": 20})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice.get("text") or choice.get("message", {}).get("content")) in choices
            assert choice["finish_reason"] == "stop"
    flag = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
            "additionalProperties": False}
    r = demo_client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 40, "temperature": 1, "seed": 5,
                                                  "response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "f", "schema": flag}}})
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"on"}, r.text
    r = demo_client.post("/v1/completions", json={"prompt": "x = ", "guided_regex": "[0-9]{3}-[a-z]{2}",
                                                  "max_tokens": 20, "temperature": 0})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"]), r.text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for extra in (dict(guided_json=schema), dict(guided_json=json.dumps(schema)), dict(structured_outputs={
            "json": schema})):
        r = demo_client.post("/v1/completions", json={"prompt": "data = ", "max_tokens": 30, **extra})
        assert set(json.loads(r.json()["choices"][0]["text"])) == {"n"}, r.text


def test_bad_response_formats_are_refused_with_the_reason(demo_client):
    cases = [({"type": "json_schema"}, "json_schema.schema"),
             ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
             ({"type": "yaml"}, "text, json_object or json_schema")]
    for fmt, words in cases:
        r = chat(demo_client, response_format=fmt)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "response_format"
    refused = [(dict(guided_regex="(a|b"), "guided_regex", "unclosed group"),
               (dict(guided_choice=[]), "guided_choice", "non-empty"),
               (dict(guided_json="{not json"), "guided_json", "guided_json"),
               (dict(structured_outputs={"grammar": "start: x"}), "structured_outputs", "not supported"),
               (dict(guided_regex="a", guided_choice=["a"]), "guided_choice", "one output structure at a time"),
               (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "one output")]
    for body, param, words in refused:
        r = demo_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert words in r.json()["error"]["message"], r.text


# -- forced tool choices, decoded under a grammar ---------------------------------------------------------------

CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def hermes_client():
    engine = Engine.from_pretrained(device="cpu")
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    with client_for(engine) as client:
        yield client


def test_a_named_or_required_choice_always_yields_valid_calls(hermes_client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for temperature in (0, 1):
        # Parallel calls allowed: the demo model, no agent, may repeat calls until max_tokens; every whole
        # block is still a valid call of the named function.
        r = chat(hermes_client, tools=[CITY, CLOCK], tool_choice=named, temperature=temperature, seed=3,
                 max_tokens=120)
        choice = ChatCompletion.model_validate(r.json()).choices[0]
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls, r.text
        assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}
        assert all(json.loads(c.function.arguments)["zone"] in ("UTC", "CET") for c in choice.message.tool_calls)
        r = chat(hermes_client, tools=[CITY, CLOCK], tool_choice="required", parallel_tool_calls=False,
                 temperature=temperature, seed=4, max_tokens=200)
        choice = ChatCompletion.model_validate(r.json()).choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, r.text
        call = choice.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"zone"}))


def test_a_forced_call_streams_as_a_tool_call_delta(hermes_client):
    r = chat(hermes_client, tools=[CITY], tool_choice="required", parallel_tool_calls=False, temperature=0,
             max_tokens=200, stream=True)
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in r.text.splitlines()
              if line.startswith("data: {")]
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert set(json.loads(calls[0].function.arguments)) == {"city"}


def test_tokenize_renders_what_the_chat_decodes_from_for_each_tool_choice(hermes_client):
    decode = hermes_client.app.state.ddtree.engine.decode
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in (None, "auto", "none", "required", named):
        body = {"messages": messages, "tools": [CITY, CLOCK], "tool_choice": choice}
        ids = hermes_client.post("/tokenize", json=body).json()["tokens"]
        r = hermes_client.post("/v1/chat/completions", json={**body, "max_tokens": 1, "return_token_ids": True})
        assert r.json()["prompt_token_ids"] == ids, choice
        assert ("get_time" in decode(ids)) == (choice != "none"), choice
    bad = {"messages": messages, "tools": [CITY], "tool_choice": named}
    r = hermes_client.post("/tokenize", json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"  # as the chat refuses it


# -- default chat template arguments ---------------------------------------------------------------------------

THINKING_TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                     "{% for m in messages %}{{ m.content }}{% endfor %}")


def test_default_chat_template_kwargs_apply_unless_the_request_sends_its_own():
    engine = Engine.from_pretrained(device="cpu")
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "hello"}]
    with client_for(engine, default_chat_template_kwargs={"enable_thinking": False}) as client:
        default = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
        asked = client.post("/tokenize", json={"messages": messages,
                                               "chat_template_kwargs": {"enable_thinking": True}}).json()["tokens"]
    assert engine.decode(default).startswith("NOTHINK") and not engine.decode(asked).startswith("NOTHINK")


def test_serve_refuses_default_chat_template_kwargs_that_are_not_a_json_object(capsys):
    from ddtree.cli import main

    for value, words in (("{nope", "is not JSON"), ("[1]", "must be a JSON object")):
        assert main(["serve", "--default-chat-template-kwargs", value]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err


# -- reasoning ----------------------------------------------------------------------------------------------------

THINK_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<think></think>"


@pytest.mark.parametrize(("text", "opened", "want"), [
    ("<think>\nfirst, the weather\n</think>\n\nSunny.", False, ("first, the weather", "Sunny.")),
    ("the weather, then\n</think>\n\nSunny.", True, ("the weather, then", "Sunny.")),
    ("Sunny.", False, (None, "Sunny.")),
    ("<think>\ncut before the end", False, ("cut before the end", "")),
    ("not <think> at the start", False, (None, "not <think> at the start")),
])
def test_reasoning_is_split_from_the_answer_whole_and_streamed(text, opened, want):
    from ddtree.reasoning import ReasoningStream, split_reasoning

    assert split_reasoning(text, opened) == want
    for cut1 in range(len(text) + 1):
        for cut2 in range(cut1, len(text) + 1, 3):
            stream = ReasoningStream(opened)
            pieces = [stream.feed(p) for p in (text[:cut1], text[cut1:cut2], text[cut2:])] + [stream.finish()]
            assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (want[0] or "", want[1])


class ThinkEngine(ToolEngine):
    PIECES = ("<think>\n", "The user wants weather.", " <tool_call>{} is not a call here", "\n</think>\n\n",
              "Sunny.", CALL, "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n")

    def __init__(self, opened: bool = False, template: str = THINK_TEMPLATE + HERMES_TEMPLATE) -> None:
        super().__init__(template)
        self.prompt = [6] if opened else [7]

    def chat_ids(self, messages, **kwargs) -> list[int]:
        self.renders.append((messages, kwargs))
        return self.prompt


def test_reasoning_content_comes_apart_from_content_and_tool_calls():
    engine = ThinkEngine()
    engine.scripts += [[prefill(0), round_([1, 2]), round_([3, 4], finish="stop")] for _ in range(2)]
    engine.scripts += [[prefill(0), round_([1, 3]), round_([5], finish="stop")]]
    with client_for(engine) as client:
        message = chat(client).json()["choices"][0]["message"]
        r = chat(client, stream=True)
        called = chat(client, tools=[WEATHER]).json()["choices"][0]
    assert message["reasoning_content"] == "The user wants weather. <tool_call>{} is not a call here"
    assert message["content"] == "Sunny."
    deltas = [ChatCompletionChunk.model_validate(json.loads(line[6:])).choices[0].delta
              for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == "Sunny."
    assert called["finish_reason"] == "tool_calls"
    assert called["message"]["reasoning_content"] == "The user wants weather."
    assert called["message"]["content"] is None and len(called["message"]["tool_calls"]) == 1


def test_a_prompt_that_opens_the_think_block_and_the_parser_switch():
    engine = ThinkEngine(opened=True)
    engine.scripts.append([prefill(1), round_([3, 4], finish="stop")])
    with client_for(engine) as client:
        message = chat(client).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Sunny.", "reasoning_content": "The user wants weather."}
    engine = ThinkEngine()
    engine.scripts.append([prefill(0), round_([1, 3, 4], finish="stop")])
    with client_for(engine, reasoning_parser="none") as client:
        message = chat(client).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>\nThe user wants weather.\n</think>\n\nSunny."}
    engine = ThinkEngine(template=HERMES_TEMPLATE)  # a template without think blocks: no parser under auto
    engine.scripts.append([prefill(0), round_([1, 3, 4], finish="stop")])
    with client_for(engine) as client:
        assert "reasoning_content" not in chat(client).json()["choices"][0]["message"]
