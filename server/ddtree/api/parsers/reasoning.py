"""Reasoning in a reply, as Qwen3-style models write it: `<think>…</think>` before the answer.

vLLM's `qwen3` reasoning parser returns the part inside the tags as `reasoning_content` and the rest as
`content`; so does this module. Some templates open the block in the prompt (the reply then starts inside
it and only closes it): the caller says so with `opened`. A reply that neither starts inside a block nor
opens one is all content; one whose block never closes (it was cut) is all reasoning. The newlines around
the tags are dropped.
"""

from __future__ import annotations

from ddtree.api.parsers.tools import held_tail

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, or None without a think block; content) of a finished reply."""
    return _split(text, opened, finished=True)


def _split(text: str, opened: bool, finished: bool) -> tuple[str | None, str]:
    """The split of `text`; unless `finished`, only the part that more text cannot change (a prefix of the
    final split: nothing while the reply might still open a block)."""
    stripped = text.lstrip()
    if not opened and not stripped.startswith(OPEN):
        if not finished and OPEN.startswith(stripped):
            return None, ""
        return None, text
    body = stripped.removeprefix(OPEN).lstrip("\n")
    end = body.find(CLOSE)
    if end >= 0:
        return body[:end].rstrip("\n"), body[end + len(CLOSE):].lstrip("\n")
    if finished:
        return body.rstrip("\n"), ""
    # The trailing newlines and a partial closing tag may yet turn out to stand before </think>.
    return body[:len(body) - held_tail(body, CLOSE)].rstrip("\n"), ""


class ReasoningStream:
    """A streamed reply split as it comes: `feed` returns the (reasoning, content) that can go out now; the
    pieces add up to `split_reasoning` of the whole reply once `finish` has returned the rest."""

    def __init__(self, opened: bool = False) -> None:
        self.opened = opened
        self.text = ""
        self.sent = ("", "")

    def feed(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._release(finished=False)

    def finish(self) -> tuple[str, str]:
        return self._release(finished=True)

    def _release(self, finished: bool) -> tuple[str, str]:
        reasoning, content = _split(self.text, self.opened, finished)
        reasoning = reasoning or ""
        new = reasoning[len(self.sent[0]):], content[len(self.sent[1]):]
        self.sent = reasoning, content
        return new
