"""A chat reply's text as OpenAI messages carry it: `reasoning_content`, `content` and `tool_calls`.

Reasoning comes first (ddtree.reasoning), then tool-call blocks are taken out of what is left
(ddtree.tools). Whole replies and streamed ones split the same way; streamed, every piece of text goes out
as soon as no later text can change where it belongs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddtree.api.parsers.reasoning import ReasoningStream, split_reasoning
from ddtree.api.parsers.tools import ToolCallStream, split_tool_calls


def template_mentions(template: object, marker: str) -> bool:
    """Whether a tokenizer's chat template (a string, or a dict of named templates) contains `marker`: how
    the parsers tell that a model writes tool-call blocks or think blocks."""
    if isinstance(template, dict):
        return any(template_mentions(t, marker) for t in template.values())
    return isinstance(template, str) and marker in template


def finish_reason(reason: str | None, calls: list[dict[str, Any]] | None) -> str | None:
    """OpenAI's finish reason for a reply: `tool_calls` when it ended by itself with calls in it."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass(frozen=True)
class ReplyFormat:
    """How a chat's reply is split: reasoning (and whether the prompt opened the block), tool calls."""

    reasoning: bool = False
    reasoning_opened: bool = False
    tool_calls: bool = False
    parallel_tool_calls: bool = True

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a finished reply (without `role`)."""
        message: dict[str, Any] = {"content": text}
        if self.reasoning:
            reasoning, message["content"] = split_reasoning(text, self.reasoning_opened)
            message["reasoning_content"] = reasoning or None
        if self.tool_calls:
            message["content"], calls = split_tool_calls(message["content"], parallel=self.parallel_tool_calls)
            if calls:
                message["tool_calls"] = calls
        return message


class ReplyStream:
    """One streamed choice: `feed` and `finish` return the deltas to send now, in order (maybe none)."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self.reasoning = ReasoningStream(fmt.reasoning_opened) if fmt.reasoning else None
        self.tools = ToolCallStream(fmt.parallel_tool_calls) if fmt.tool_calls else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return _deltas(reasoning, self.tools.feed(content) if self.tools else _content(content))

    def finish(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the last deltas, the tool calls sent)."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return _deltas(reasoning, _content(content)), []
        return _deltas(reasoning, self.tools.finish(content)), self.tools.calls


def _content(text: str) -> list[dict[str, Any]]:
    return [{"content": text}] if text else []


def _deltas(reasoning: str, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning goes first: it comes before the answer in the reply."""
    return [{"reasoning_content": reasoning}, *deltas] if reasoning else deltas
