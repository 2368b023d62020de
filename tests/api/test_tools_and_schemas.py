"""Structured replies through the API: Hermes <tool_call> blocks become OpenAI `tool_calls` (streamed and not;
forced choices refused), and `response_format` JSON objects and schemas constrain decoding."""

from __future__ import annotations

import json
import random
import re

import openai
import pytest
from ddtree.api.app import create_app
from ddtree.api.config import ServerConfig
from ddtree.api.parsers.tools import START, ToolCallStream, split_tool_calls, template_message
from ddtree.api.replies import ReplyFormat, ReplyStream, template_mentions
from ddtree.engine import Engine
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from scripted_engine import ScriptedEngine, prefill, round_
from servers import wait_ready

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


# Replies as a model may write them: content, one or two calls, reasoning; and blocks that are not calls.
OSLO = CALL.replace("Paris", "Oslo")
CLOCK_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "at": [1, {"x": "}]"}]}}\n</tool_call>'
REPLIES = [
    (f"I'll check.\n{CALL}", False),
    (f"  Let me look.\n{CALL}\n{OSLO}\nDone, mostly. \n", False),
    (f"\n{CALL}\n\n{CLOCK_CALL}\n\nBoth asked.", False),
    (f"<think>\nThe weather, then the time.\n</think>\n\nSure.\n{CALL}\n{CLOCK_CALL}", False),
    (f"the weather\n</think>\n\n{OSLO}", True),
    (f"<tool_call>not json</tool_call> then {CALL} and <tool_call>[1, 2]</tool_call>", False),
    ('<tool_call>{"arguments": {"q": "a <tool_call> b </tool"}, "name": "search"}</tool_call>', False),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": \\"</\\"}"}</tool_call><tool_call>{"name": "g"}</tool_call>',
     False),
    ('<tool_call>\n{\n  "name": "f",\n  "parameters": {\n    "x": 1e3\n  },\n  "arguments": 7\n}', False),
    ('<tool_call>{"name": "f", "arguments": 12}</tool_call>', False),
    (f"a<tool_c{CALL}", False),
    ("  plain answer, no calls at all <tool", False),
]


def reassemble(deltas: list[dict]) -> dict:
    """A streamed choice's deltas put together as OpenAI clients do, checking each tool-call entry's shape:
    a call's first entry names it (arguments ""), later ones carry only argument pieces."""
    message = {"reasoning_content": "", "content": "", "tool_calls": []}
    for delta in deltas:
        message["reasoning_content"] += delta.get("reasoning_content", "")
        message["content"] += delta.get("content", "")
        for entry in delta.get("tool_calls", ()):
            calls = message["tool_calls"]
            if entry["index"] == len(calls):
                assert set(entry) == {"index", "id", "type", "function"} and entry["function"]["arguments"] == ""
                calls.append({key: entry[key] for key in ("id", "type", "function")})
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return message


def streamed(fmt: ReplyFormat, pieces: list[str]) -> tuple[dict, list[dict]]:
    stream = ReplyStream(fmt)
    deltas = [delta for piece in pieces for delta in stream.feed(piece)]
    last, calls = stream.finish()
    return reassemble(deltas + last), calls


@pytest.mark.parametrize(("text", "opened"), REPLIES)
def test_streamed_pieces_add_up_to_the_whole_reply_wherever_the_rounds_cut_it(text, opened):
    rng = random.Random(text)
    for parallel in (True, False):
        fmt = ReplyFormat(reasoning=True, reasoning_opened=opened, tool_calls=True, parallel_tool_calls=parallel)
        whole = fmt.message(text)
        want = {"reasoning_content": whole["reasoning_content"] or "", "content": whole["content"] or "",
                "tool_calls": [(c["type"], c["function"]) for c in whole.get("tool_calls", ())]}
        for _ in range(300):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, 8)))
            message, calls = streamed(fmt, [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)])
            assert calls == message["tool_calls"] and all(c["id"].startswith("call_") for c in calls)
            message["tool_calls"] = [(c["type"], c["function"]) for c in calls]
            assert message == want, (parallel, cuts)


def test_the_whole_reply_keeps_the_arguments_as_written_and_trims_only_around_the_calls():
    # The leading spaces stay: a stream sends them before it can know a call will follow.
    assert split_tool_calls(f"  Let me look.\n{CALL}\n{OSLO}\nDone. \n")[0] == "  Let me look.\n\n\nDone."
    assert split_tool_calls(f"\n {CALL}\n Done.")[0] == "Done."
    text = '<tool_call>{"name":"f","arguments":{"city":"Par\\u00eds"},"parameters":{"y":2}}</tool_call>'
    assert split_tool_calls(text)[1][0]["function"] == {"name": "f", "arguments": '{"city":"Par\\u00eds"}'}


def test_a_call_goes_out_as_soon_as_its_name_and_each_piece_of_its_arguments_are_known():
    stream = ToolCallStream()
    first = stream.feed('Hi <tool_call>\n{"name": "get_weather"')
    assert first[0] == {"content": "Hi"} and first[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                                     "arguments": ""}
    assert stream.feed(', "arguments": {"city": "Pa') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}]
    assert stream.feed('ris"}}\n</tool_') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert stream.feed("call> ok") == [{"content": "  ok"}] and stream.finish() == []


def test_a_named_call_stands_in_the_stream_when_its_block_breaks_later():
    fmt = ReplyFormat(tool_calls=True)
    cut = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'  # max_tokens hit here
    assert fmt.message(cut) == {"content": cut}
    message, _ = streamed(fmt, [cut[:20], cut[20:]])
    assert message["content"] == "Sure." and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Par'}
    broken = 'Hi <tool_call>{"name": "f", "arguments": {"x": 1}} oops</tool_call>'
    assert fmt.message(broken) == {"content": broken}
    message, _ = streamed(fmt, [broken])
    assert message["content"] == "Hi" and message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    never = "Hi <tool_call>not a call</tool_call>"  # no name was read: held whole, then content
    assert streamed(fmt, list(never))[0] == {"reasoning_content": "", "content": never, "tool_calls": []}


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
    wait_ready(client)
    return client


def chat(client: TestClient, **body):
    return client.post("/v1/chat/completions", json={"model": served(client), "messages": [
        {"role": "user", "content": "Paris?"}], **body})


def served(client: TestClient) -> str:
    """The model id requests name."""
    return client.get("/v1/models").json()["data"][0]["id"]


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


class TwoCallEngine(ToolEngine):
    """Content and two calls, the first one's arguments written over three rounds."""

    PIECES = ("Checking both.\n", '<tool_call>\n{"name": "get_weather", "argu', 'ments": {"ci', 'ty": "Pa',
              'ris"}}\n</tool', '_call>\n<tool_call>\n{"name": "get_time", ', '"arguments": {"zone": "CET"}}',
              "\n</tool_call>\nDone.")
    vocab_size = len(PIECES)


def test_the_openai_sdk_stream_accumulates_the_calls_of_the_whole_reply_piece_by_piece():
    engine = TwoCallEngine()
    engine.scripts += [[prefill(0), round_([1]), round_([2]), round_([3]), round_([4, 5]), round_([6]),
                        round_([7], finish="stop")] for _ in range(2)]
    # The SDK's stream helper parses the arguments of strict tools only.
    tools = [{"type": "function", "function": {**t["function"], "strict": True}} for t in (CITY, CLOCK)]
    messages = [{"role": "user", "content": "Weather and time?"}]
    with client_for(engine) as client:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
        whole = sdk.chat.completions.create(model="scripted", messages=messages, tools=tools).choices[0]
        with sdk.chat.completions.stream(model="scripted", messages=messages, tools=tools) as stream:
            events = list(stream)
            streamed = stream.get_final_completion().choices[0]
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert whole.message.content == streamed.message.content == "Checking both.\n\n\nDone."
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole.message.tool_calls)] == [
        (0, "get_weather", '{"city": "Paris"}'), (1, "get_time", '{"zone": "CET"}')]
    assert all(c.id.startswith("call_") for c in streamed.message.tool_calls + whole.message.tool_calls)
    pieces = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta" and e.index == 0]
    assert pieces == ["", '{"ci', 'ty": "Pa', 'ris"}']  # as the rounds wrote them, never the call's closing brace
    done = [e.parsed_arguments for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done == [{"city": "Paris"}, {"zone": "CET"}]


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
        r = client.post("/v1/chat/completions", json={"model": "scripted", "messages": messages, "tools": [WEATHER]})
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
        r = client.post("/v1/chat/completions", json={"model": "ddtree-demo", "messages": messages, "tools": [WEATHER],
                                                      "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == ids  # the chat endpoint decoded from the same rendering


# -- response_format ------------------------------------------------------------------------------------------


DEMO = {"model": "ddtree-demo"}


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
            r = demo_client.post(path, json={**body, **extra, **DEMO, "temperature": 1, "seed": 2, "max_tokens": 20})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice.get("text") or choice.get("message", {}).get("content")) in choices
            assert choice["finish_reason"] == "stop"
    flag = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
            "additionalProperties": False}
    r = demo_client.post("/v1/completions", json={**DEMO, "prompt": "x = ", "max_tokens": 40, "temperature": 1,
                                                  "seed": 5, "response_format": {"type": "json_schema", "json_schema": {
                                                      "name": "f", "schema": flag}}})
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"on"}, r.text
    r = demo_client.post("/v1/completions", json={**DEMO, "prompt": "x = ", "guided_regex": "[0-9]{3}-[a-z]{2}",
                                                  "max_tokens": 20, "temperature": 0})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"]), r.text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for extra in (dict(guided_json=schema), dict(guided_json=json.dumps(schema)), dict(structured_outputs={
            "json": schema})):
        r = demo_client.post("/v1/completions", json={**DEMO, "prompt": "data = ", "max_tokens": 30, **extra})
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
        r = demo_client.post("/v1/chat/completions",
                             json={**DEMO, "messages": [{"role": "user", "content": "x"}], **body})
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


def test_a_forced_call_streams_the_arguments_of_the_whole_reply(hermes_client):
    body = dict(tools=[CITY], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
    whole = ChatCompletion.model_validate(chat(hermes_client, **body).json()).choices[0].message.tool_calls
    r = chat(hermes_client, **body, stream=True)
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in r.text.splitlines()
              if line.startswith("data: {")]
    entries = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert entries[0].function.name == "get_weather" and entries[0].function.arguments == ""
    assert len(entries) > 2 and all(e.index == 0 and e.id is None and e.function.name is None for e in entries[1:])
    assert "".join(e.function.arguments for e in entries) == whole[0].function.arguments
    assert set(json.loads(whole[0].function.arguments)) == {"city"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tokenize_renders_what_the_chat_decodes_from_for_each_tool_choice(hermes_client):
    decode = hermes_client.app.state.ddtree.engine.decode
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in (None, "auto", "none", "required", named):
        body = {"messages": messages, "tools": [CITY, CLOCK], "tool_choice": choice}
        ids = hermes_client.post("/tokenize", json=body).json()["tokens"]
        r = hermes_client.post("/v1/chat/completions",
                               json={**body, "model": served(hermes_client), "max_tokens": 1, "return_token_ids": True})
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


def test_chat_template_kwargs_may_not_set_the_template_calls_own_arguments():
    """A client's chat_template_kwargs reach the template, never `apply_chat_template`'s own arguments: one that
    would run its own template, skip the tokenization or change the encoding gets a 400 naming the key, with
    what to send instead; the chat and /tokenize alike, and nothing reaches the engine."""
    engine = Engine.from_pretrained(device="cpu")
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "hello"}]
    cases = [({"tokenize": False}, "'tokenize'", "server sets"),
             ({"chat_template": "{{ 7 * 7 }}", "enable_thinking": False}, "'chat_template'", "server sets"),
             ({"tokenizer_kwargs": {"add_special_tokens": True}, "truncation": True}, "'tokenizer_kwargs'", ""),
             ({"add_generation_prompt": False}, "'add_generation_prompt'", "request's own field")]
    with client_for(engine) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for kwargs, named, hint in cases:
            for path, body in (("/v1/chat/completions", {"model": model, "max_tokens": 2}), ("/tokenize", {})):
                r = client.post(path, json=body | {"messages": messages, "chat_template_kwargs": kwargs})
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == "chat_template_kwargs", (path, kwargs)
                assert named in error["message"] and hint in error["message"], error["message"]
        # the template's own variables still pass
        r = client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200 and engine.decode(r.json()["tokens"]).startswith("NOTHINK")


def test_serve_refuses_default_chat_template_kwargs_that_are_not_a_json_object(capsys):
    from ddtree.cli import main

    for value, words in (("{nope", "is not JSON"), ("[1]", "must be a JSON object"),
                         ('{"tokenize": false}', "may not set 'tokenize'")):
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
    from ddtree.api.parsers.reasoning import ReasoningStream, split_reasoning

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


# -- reasoning before a grammar ------------------------------------------------------------------------------------

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"], "additionalProperties": False}
FLAG_FORMAT = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}


def valid_flag(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


class ThinkJsonEngine(ToolEngine):
    """Pieces of a reply that thinks, then answers in JSON; <think> and </think> are single tokens."""

    PIECES = ("<think>", "\nThe user wants a flag.\n", "</think>", "\n\n", '{"ok": true, ', '"n": 2}', CALL,
              "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n",
              "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    vocab_size = len(PIECES)

    def __init__(self, prompt: int = 7, tags: bool = True) -> None:
        super().__init__(THINK_TEMPLATE + HERMES_TEMPLATE)
        self.prompt, self.tags = [prompt], tags  # 7: no block in the prompt; 8: opened; 9: closed

    def encode(self, text: str) -> list[int]:
        return [self.PIECES.index(text)] if self.tags and text in self.PIECES else [0, 1]

    def chat_ids(self, messages, **kwargs) -> list[int]:
        self.renders.append((messages, kwargs))
        return self.prompt


def chat_both_ways(client: TestClient, **body) -> tuple[dict, dict, str]:
    """(the message, the streamed deltas put together, the streamed finish reason) of one request each way."""
    whole = chat(client, **body).json()["choices"][0]
    chunks = [json.loads(line[6:]) for line in chat(client, **body, stream=True).text.splitlines()
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = {key: value or None for key, value in reassemble(deltas).items()}
    return whole["message"], streamed, (whole["finish_reason"], chunks[-1]["choices"][0]["finish_reason"])


def test_a_constrained_reply_thinks_first_and_answers_in_the_schema():
    """Inside a block the prompt opened, or one the reply opens with its first token; a reply that starts
    with the answer instead has no reasoning (the grammar applied from its first token)."""
    from ddtree.core.sampling import ThinkBlock

    answer = '{"ok": true, "n": 2}'
    for prompt, reply, reasoning in ((7, [0, 1, 2, 3, 4, 5], "The user wants a flag."),
                                     (8, [1, 2, 3, 4, 5], "The user wants a flag."), (7, [4, 5], None)):
        engine = ThinkJsonEngine(prompt)
        *pieces, last = [reply[i:i + 2] for i in range(1, len(reply), 2)]
        engine.scripts += [[prefill(reply[0]), *map(round_, pieces), round_(last, finish="stop")]] * 2
        with client_for(engine) as client:
            message, streamed, reasons = chat_both_ways(client, response_format=FLAG_FORMAT)
        assert [p.think for p in engine.params] == [ThinkBlock(0, 2, opened=prompt == 8)] * 2
        assert engine.params[0].grammar and reasons == ("stop", "stop") and valid_flag(message["content"])
        assert message == {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        assert streamed == {"reasoning_content": reasoning, "content": answer, "tool_calls": None}


def test_a_think_block_cut_by_max_tokens_is_reasoning_with_no_content():
    engine = ThinkJsonEngine()
    engine.scripts += [[prefill(0), round_([1], finish="length")]] * 2
    with client_for(engine) as client:
        message, streamed, reasons = chat_both_ways(client, response_format=FLAG_FORMAT, max_tokens=2)
    assert message == {"role": "assistant", "content": "", "reasoning_content": "The user wants a flag."}
    assert reasons == ("length", "length")
    assert streamed == {"reasoning_content": "The user wants a flag.", "content": None, "tool_calls": None}


def test_a_forced_tool_call_comes_after_the_think_block():
    engine = ThinkJsonEngine()
    engine.scripts.append([prefill(0), round_([1, 2, 3]), round_([6], finish="stop")])
    with client_for(engine) as client:
        choice = chat(client, tools=[WEATHER], tool_choice="required").json()["choices"][0]
    assert engine.params[0].grammar and engine.params[0].think.close == 2
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "The user wants a flag."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize(("case", "config", "body"), [
    ("the template closed the block", {"prompt": 9}, {}),
    ("enable_thinking false", {}, {"chat_template_kwargs": {"enable_thinking": False}}),
    ("enable_thinking false by default", {"default_chat_template_kwargs": {"enable_thinking": False}}, {}),
    ("no reasoning parser", {"reasoning_parser": "none"}, {}),
    ("no single-token tags", {"tags": False}, {}),
])
def test_without_thinking_the_grammar_applies_from_the_first_token_as_before(case, config, body):
    engine = ThinkJsonEngine(**{k: v for k, v in config.items() if k in ("prompt", "tags")})
    engine.scripts.append([prefill(4), round_([5], finish="stop")])
    server = {k: v for k, v in config.items() if k not in ("prompt", "tags")}
    with client_for(engine, **server) as client:
        message = chat(client, response_format=FLAG_FORMAT, **body).json()["choices"][0]["message"]
    assert engine.params[0].grammar and engine.params[0].think is None, case
    assert message == {"role": "assistant", "content": '{"ok": true, "n": 2}'}, case


# A Qwen3-style template: it opens the think block for the model, or writes an empty one without thinking.
QWEN3_STYLE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
               "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    """A tiny random target and draft under the demo's tokenizer with <think> and </think> added as tokens."""
    from ddtree.engine.engine import ASSETS
    from tiny import make_draft, make_target
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("thinking")
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "target")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_STYLE
    vocab = len(tokenizer) + 2  # the model's own EOS and mask rows past the tokenizer's
    make_target(root / "target", vocab=vocab)
    tokenizer.save_pretrained(root / "target")
    make_draft(root / "draft", vocab=vocab)
    with client_for(Engine.from_pretrained(root / "target", root / "draft", device="cpu")) as client:
        yield client


def test_a_real_constrained_reply_thinks_then_writes_json_that_validates(thinking_client):
    close = thinking_client.app.state.ddtree.engine.encode("</think>")[0]
    decode = thinking_client.app.state.ddtree.engine.decode
    thought = 0
    for seed in range(3):  # the random model, biased towards </think>, closes the block early or late
        body = dict(response_format=FLAG_FORMAT, temperature=1, seed=seed, max_tokens=60, logit_bias={str(close): 5})
        r = chat(thinking_client, **body, return_token_ids=True).json()["choices"][0]
        message, ids = r["message"], r["token_ids"]
        if r["finish_reason"] == "stop":
            assert ids.count(close) == 1 and valid_flag(message["content"]), r
            assert message["content"] == decode(ids[ids.index(close) + 1:])
            assert message["reasoning_content"] == (decode(ids[:ids.index(close)]).strip() or None)
            thought += message["reasoning_content"] is not None
        again, streamed, reasons = chat_both_ways(thinking_client, **body)
        assert again == message and reasons == (r["finish_reason"],) * 2
        assert streamed == {"reasoning_content": message["reasoning_content"], "content": message["content"] or None,
                            "tool_calls": None}
    assert thought
    cut = chat(thinking_client, response_format=FLAG_FORMAT, temperature=0, max_tokens=8).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["reasoning_content"] and not cut["message"]["content"]
    off = chat(thinking_client, response_format=FLAG_FORMAT, temperature=0, max_tokens=60,
               chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]
    assert off["finish_reason"] == "stop" and valid_flag(off["message"]["content"])
    assert "reasoning_content" not in off["message"]
