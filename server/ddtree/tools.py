"""Tool calls in the Hermes format, turned into OpenAI `tool_calls`.

Qwen3's chat template (and Qwen2.5's, Hermes', and many fine-tunes') renders a request's `tools` into the
system prompt and teaches the model to answer with blocks like

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The reply is split into plain content and calls (as vLLM's `hermes` parser does). With `tool_choice`
`auto` decoding is unchanged. A forced choice (`required`, or a named function) decodes under a grammar
(ddtree.grammar) that admits only such blocks, naming an offered function with arguments that match its
parameters schema.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ddtree.grammar import LAYOUT

START, END = "<tool_call>", "</tool_call>"


def forced_call_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """The Lark source of a forced choice: <tool_call> blocks (one, or one or more with `parallel`) whose
    JSON calls the function `name` (None: any offered one) with arguments valid for its parameters."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}} for f in functions]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": LAYOUT}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: "{START}\\n" body "\\n{END}"\n'
            f"body: %json {json.dumps(schema)}\n")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI assistant message's `tool_calls` as chat templates read them: arguments as a dict when they
    are a JSON object (Llama's templates need one; Qwen's take either), the call's `function` as is."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    rendered = []
    for call in calls:
        function = dict(call.get("function") or {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = function.get("arguments")
        if isinstance(arguments, dict):
            function["arguments"] = arguments
        rendered.append({**call, "function": function})
    return {**message, "tool_calls": rendered}


def split_tool_calls(text: str, *, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished reply.

    Every block holding a JSON object with a string "name" becomes a call (an unterminated last block too,
    when its JSON is whole: a stop string can cut the closing tag). Anything else, malformed blocks
    included, stays in the content, so nothing the model wrote is lost. Without calls the text comes back
    unchanged; with calls the content is what is left, stripped, or None. `parallel=False` keeps the first
    call only (OpenAI's `parallel_tool_calls: false`).
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(START, pos)) >= 0:
        end = text.find(END, start)
        stop = len(text) if end < 0 else end + len(END)
        call = _call(text[start + len(START):len(text) if end < 0 else end])
        kept.append(text[pos:start])
        if call is None:
            kept.append(text[start:stop])
        elif parallel or not calls:
            calls.append(call)
        pos = stop
    kept.append(text[pos:])
    if not calls:
        return text, []
    content = "".join(kept).strip()
    return content or None, calls


def _call(payload: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (to hold back while streaming)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ToolCallStream:
    """A streamed reply with its tool calls held back.

    `feed` returns the text that can go out as content now: everything before the first <tool_call>,
    less a tail that could be the start of one. From the first block on, everything is held, and `finish`
    splits it into the content left over and the calls, sent once the reply has ended.
    """

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.held = ""
        self.in_calls = False

    def feed(self, text: str) -> str:
        text, self.held = self.held + text, ""
        if self.in_calls:
            self.held = text
            return ""
        start = text.find(START)
        if start >= 0:
            self.in_calls, self.held = True, text[start:]
            return text[:start]
        tail = held_tail(text, START)
        self.held = text[len(text) - tail:]
        return text[:len(text) - tail]

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        held, self.held = self.held, ""
        if not self.in_calls:
            return held or None, []
        content, calls = split_tool_calls(held, parallel=self.parallel)
        return (content if calls else held) or None, calls
