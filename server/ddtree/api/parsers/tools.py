"""Tool calls in the Hermes format, turned into OpenAI `tool_calls`.

Qwen3's chat template (and Qwen2.5's, Hermes', and many fine-tunes') renders a request's `tools` into the
system prompt and teaches the model to answer with blocks like

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The reply is split into plain content and calls (as vLLM's `hermes` parser does), whole or as it streams,
a call's arguments as they are generated. With `tool_choice` `auto` decoding is unchanged. A forced choice
(`required`, or a named function) decodes under a grammar (ddtree.grammar) that admits only such blocks,
naming an offered function with arguments that match its parameters schema.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ddtree.core.grammar import LAYOUT

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

    Every block holding a JSON object whose (first) "name" is a string becomes a call (an unterminated last
    block too, when its JSON is whole: a stop string can cut the closing tag); its arguments are the first
    "arguments" (or "parameters") member as the model wrote it, a JSON string unquoted, {} when there is
    none (streamed arguments can only be the model's own text). Anything else, malformed blocks included,
    stays in the content, so nothing the model wrote is lost. Without calls the text comes back unchanged;
    with calls the content is what is left, or None, less the whitespace at its end and, when only
    whitespace came before the first call, at its start (as ToolCallStream can send it).
    `parallel=False` keeps the first call only (OpenAI's `parallel_tool_calls: false`).
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    blank_start = False
    pos = 0
    while (start := text.find(START, pos)) >= 0:
        end = text.find(END, start)
        stop = len(text) if end < 0 else end + len(END)
        block = _Block()
        block.feed(text[start + len(START):len(text) if end < 0 else end])
        kept.append(text[pos:start])
        if not block.end():
            kept.append(text[start:stop])
        elif parallel or not calls:
            blank_start = blank_start or (not calls and not "".join(kept).strip())
            calls.append(_new_call(block.name, block.arguments))
        pos = stop
    kept.append(text[pos:])
    if not calls:
        return text, []
    content = "".join(kept).rstrip()
    return (content.lstrip() if blank_start else content) or None, calls


def _new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_WS = "[ \t\n\r]*"
_KEY = r'"(?:[^"\\]|\\.)*"'
_FIRST_MEMBER = re.compile(rf"{_WS}\{{{_WS}({_KEY}){_WS}:{_WS}", re.S)  # `{ "key": ` up to the value
_NEXT_MEMBER = re.compile(rf"{_WS},{_WS}({_KEY}){_WS}:{_WS}", re.S)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(")?|[][{}]', re.S)  # a string (its closing quote, once there) or a bracket
_SCALAR = re.compile(r"[-+.\w]*")  # a number, true, false, null (NaN, Infinity: Python's json reads them)
_ARGUMENTS = ("arguments", "parameters")


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value at `start` ends, or None while more text may belong to it. It is not checked
    (the block's JSON is, once whole): for valid JSON the end is json's."""
    if text[start] in "{[":
        depth = 0
        for token in _TOKEN.finditer(text, start):
            if token[0][0] == '"':
                if token[1] is None:
                    return None
            else:
                depth += 1 if token[0] in "{[" else -1
                if depth == 0:
                    return token.end()
        return None
    if text[start] == '"':
        token = _TOKEN.match(text, start)
        return token.end() if token[1] else None
    end = _SCALAR.match(text, start).end()
    if end == start:
        raise ValueError("no JSON value")
    return end if end < len(text) else None


class _Block:
    """The JSON of one <tool_call> block, read member by member as it grows, so that a call can stream.

    `name` is the first "name" member once read (None unless a string); `arguments` the text of the first
    "arguments" or "parameters" member known so far: an object or array as the model writes it, up to its
    closing bracket; a string (unquoted) or another scalar once whole. Whether the block is a call at all is
    only known at its end (`end`)."""

    def __init__(self) -> None:
        self.text = ""
        self.pos: int | None = 0  # where the next member starts; None: nothing more to read
        self.member: tuple[str, int] | None = None  # (key, where its value starts) of the member being read
        self.named = False
        self.name: str | None = None
        self.start: int | None = None  # where the arguments value starts
        self.arguments = ""

    def feed(self, text: str) -> None:
        self.text += text
        try:
            while self.pos is not None and self._member():
                pass
        except ValueError:  # unreadable JSON: the block cannot be a call (but what was read stands)
            self.pos = None

    def _member(self) -> bool:
        """Read the next member, or as much of it as has come (False)."""
        if self.member is None:
            header = (_NEXT_MEMBER if self.pos else _FIRST_MEMBER).match(self.text, self.pos)
            if header is None or header.end() == len(self.text):
                return False
            self.member = json.loads(header[1]), header.end()
        key, start = self.member
        end = _value_end(self.text, start)
        arguments = key in _ARGUMENTS and self.start in (None, start)
        if arguments:
            self.start = start
            if self.text[start] in "{[":
                self.arguments = self.text[start:end]
        if end is None:
            return False
        self.pos, self.member = end, None
        if arguments and self.text[start] == '"':
            self.arguments = json.loads(self.text[start:end])
        elif arguments and self.text[start] not in "{[":
            self.arguments = self.text[start:end]
        elif key == "name" and not self.named:
            self.named = True
            name = json.loads(self.text[start:end])
            self.name = name if isinstance(name, str) else None
            if self.name is None:
                self.pos = None
        return True

    def end(self) -> bool:
        """Whether the whole block is a call: a JSON object whose first "name" is a string (its arguments
        default to {})."""
        try:
            whole = json.loads(self.text)
        except ValueError:
            return False
        if not isinstance(whole, dict) or self.name is None:
            return False
        if self.start is None:
            self.arguments = "{}"
        return True


def held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (to hold back while streaming)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ToolCallStream:
    """A streamed reply split as it comes into content and tool calls, in OpenAI's streaming shape.

    `feed` and `finish` return the deltas to send now, in order: `{"content": …}` or `{"tool_calls":
    [entry]}`. A call's first entry carries its index, id, type and name (arguments "") and goes out as soon
    as its block's "name" has been read; later entries carry pieces of its arguments as the model writes
    them, never past where the arguments value is known to go on (not a possible </tool_call>, not the
    call object's closing brace). Whitespace at the end of the content waits for what follows it, and a
    block not (yet) known to be a call is held until it ends, then goes out as content unless it is one;
    with `parallel=False` blocks after the first call are held and dropped if they are calls. So the pieces
    add up to `split_tool_calls` of the whole reply, but for one case where a stream cannot wait:

    a call, once named, stands. Should its block turn out malformed (cut by max_tokens or a stop string
    before its JSON closed, broken JSON after the name, a </tool_call> inside a string), the stream keeps
    the call with the arguments sent so far (as OpenAI streams a call cut by max_tokens) and drops the
    rest of the block, where the whole reply keeps the block as content.
    """

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls: list[dict[str, Any]] = []  # the calls sent, with the arguments sent so far
        self.block: _Block | None = None  # the block being read
        self.streaming = False  # the open block's call has gone out
        self.held = ""  # a tail that may start a tag: <tool_call>, or </tool_call> inside a block
        self.space = ""  # whitespace at the end of the content, sent only if content follows
        self.sent = False  # some content has gone out
        self.deltas: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        text, self.held = self.held + text, ""
        while True:
            tag = START if self.block is None else END
            at = text.find(tag)
            cut = at if at >= 0 else len(text) - held_tail(text, tag)
            if self.block is None:
                self._content(text[:cut])
            else:
                self._extend(text[:cut])
            if at < 0:
                self.held = text[cut:]
                deltas, self.deltas = self.deltas, []
                return deltas
            text = text[at + len(tag):]
            if self.block is None:
                self.block = _Block()
            else:
                self._close(closed=True)

    def finish(self, text: str = "") -> list[dict[str, Any]]:
        """The last deltas, once the reply has ended (`text`: its last piece)."""
        deltas = self.feed(text)
        held, self.held = self.held, ""
        if self.block is None:
            self._content(held)
        else:
            self._extend(held)
            self._close(closed=False)
        if self.space and not self.calls:
            self._put({"content": self.space})
        return deltas + self.deltas

    def _content(self, text: str) -> None:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            self._put({"content": body.lstrip() if self.calls and not self.sent else body})
            self.sent = True

    def _extend(self, text: str) -> None:
        self.block.feed(text)
        if self.streaming or (self.block.name is not None and (self.parallel or not self.calls)):
            self._send()

    def _send(self) -> None:
        """The open block's call as far as it is known: its name first, then what is new of its arguments."""
        if not self.streaming:
            self.streaming = True
            call = _new_call(self.block.name, "")
            self.calls.append(call)
            self._put({"tool_calls": [{"index": len(self.calls) - 1, **call, "function": dict(call["function"])}]})
        function = self.calls[-1]["function"]
        if new := self.block.arguments[len(function["arguments"]):]:
            function["arguments"] += new
            self._put({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": new}}]})

    def _close(self, closed: bool) -> None:
        is_call = self.block.end()
        if self.streaming and is_call:
            self._send()  # arguments written before the name, or {} for none
        elif not self.streaming and not is_call:
            self._content(START + self.block.text + (END if closed else ""))
        self.block, self.streaming = None, False

    def _put(self, delta: dict[str, Any]) -> None:
        if "content" in delta and self.deltas and "content" in self.deltas[-1]:
            self.deltas[-1]["content"] += delta["content"]
        else:
            self.deltas.append(delta)
