"""Prompt text -> token ids for the server: chat templates with special-token text in messages read as plain
text, and a lower bound on a text's token count that refuses an impossible prompt without tokenizing it.

Role-marker injection: a chat template pastes message text between its own special tokens, and tokenizing
the result turns any `<|im_end|>` a user typed into the real end-of-turn token, so one message can forge a
turn (vLLM does this by default). With escaping on, the template still renders the same text, but only the
special tokens the template itself wrote are read as special; a user's `<|im_end|>` is tokenized like any
other text. Chats without special-token text get exactly the ids `Engine.chat_ids` gives.

Completions prompts and chats (rendered, then encoded, as `apply_chat_template(tokenize=True)` does) go through a
tokenization prefix cache (prompt_tokens.py) where the tokenizer is one it can split exactly.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from ddtree.api.prompt_tokens import PromptTokens, backend_copy

PRIVATE_USE = 0xF0000  # Supplementary Private Use Area-A: placeholders for special-token text in messages


class PromptRenderer:
    """A loaded engine's tokenizer as requests use it."""

    def __init__(self, engine: Any, *, escape_special_tokens: bool = True) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.escape = escape_special_tokens
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        self.special_ids = {token.content: token_id for token_id, token in added.items()
                            if token.special and token.content}
        self.specials = sorted(self.special_ids, key=len, reverse=True)  # the longest match first
        self._special_re = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        # The most characters one token stands for (0: unknown, no bound).
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        self.max_token_chars = max(map(len, vocab), default=0)
        self._plain_ids = _plain_encoder(self.tokenizer) if self.specials else None
        self._newline = self._plain_ids("\n") if self._plain_ids else []
        # a random-weight shape's tokenizer encodes with the tokenizer it wraps (models/shapes.py)
        self.tokens = PromptTokens(getattr(self.tokenizer, "text_encoder", self.tokenizer))
        self._encoding_options = _encoding_options() if self.tokens.family else frozenset()

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the token count of any text of `chars` characters, without tokenizing it; the 2
        leaves room for normalizers that compose characters (a token may then cover more than its length)."""
        return chars // (2 * self.max_token_chars) if self.max_token_chars else 0

    def text_ids(self, text: str) -> list[int]:
        """A completions prompt: special-token text in it is special (a raw prompt writes its own markers)."""
        return self.tokens.encode(text) if self.tokens.family else self.engine.encode(text)

    def chat_ids(self, messages: list[dict], **template: Any) -> list[int]:
        """The prompt ids of a chat (template arguments as `Engine.chat_ids` takes them)."""
        if not self.escape or self._special_re is None:
            return self._template_ids(messages, **template)
        placeholders = self._placeholders(messages)
        escaped = [_replace_strings(m, lambda s: self._special_re.sub(lambda x: placeholders[x.group()], s))
                   for m in messages]
        if escaped == messages:
            return self._template_ids(messages, **template)
        restore = {p: s for s, p in placeholders.items()}
        restore_re = re.compile("|".join(map(re.escape, restore)))
        rendered = self._render(escaped, **template)
        ids: list[int] = []
        end = 0
        for match in [*self._special_re.finditer(rendered), None]:  # only the template's own specials are left
            plain = rendered[end:match.start() if match else len(rendered)]
            if plain:
                ids += self._piece_ids(restore_re.sub(lambda x: restore[x.group()], plain), first=end == 0)
            if match:
                ids.append(self.special_ids[match.group()])
                end = match.end()
        return ids

    def _template_ids(self, messages: list[dict], **template: Any) -> list[int]:
        """`Engine.chat_ids`. `apply_chat_template(tokenize=True)` renders the chat to text and encodes that with
        add_special_tokens=False (transformers' own method: `PromptTokens` recognises no tokenizer that overrides
        it), which is what the cache encodes; template arguments that set the encoding's options keep its path."""
        if self.tokens.family is None or template.keys() & self._encoding_options:
            return self.engine.chat_ids(messages, **template)
        return self.tokens.encode(self._render(messages, **template))

    def _piece_ids(self, text: str, first: bool) -> list[int]:
        """A piece of the rendered chat between two of the template's special tokens, as plain text. Encoded
        after a newline (then dropped) where it does not start the chat, as transformers encodes such pieces:
        SentencePiece tokenizers would otherwise give it the prefix space of a text's start."""
        if not first:
            ids = self._plain_ids("\n" + text)
            if ids[:len(self._newline)] == self._newline:
                return ids[len(self._newline):]
        return self._plain_ids(text)

    def _render(self, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, **template: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt and not continue_final_message, **template)

    def _placeholders(self, messages: list[dict]) -> dict[str, str]:
        """One private-use character per special token, none of which the messages already hold."""
        text = repr(messages)
        free = (chr(c) for c in range(PRIVATE_USE, PRIVATE_USE + 65534) if chr(c) not in text)
        return {special: next(free) for special in self.specials}


def template_kwargs_refusal(kwargs: dict[str, Any]) -> str | None:
    """Why `kwargs` (a request's chat_template_kwargs, or the server's defaults) may not be used ("may not set
    'tokenize': ..."), or None when it sets only the template's own variables."""
    reserved = sorted(kwargs.keys() & _reserved_arguments())
    if not reserved:
        return None
    fields = [n for n in reserved if n in ("add_generation_prompt", "continue_final_message")]
    hint = (f"send {' and '.join(fields)} as the request's own field{'s' if len(fields) > 1 else ''}." if fields
            else "these are the chat template call's own arguments, which the server sets.")
    return f"may not set {', '.join(map(repr, reserved))}: {hint}"


@functools.cache  # every chat request asks
def _reserved_arguments() -> frozenset[str]:
    """`apply_chat_template`'s own arguments, which chat_template_kwargs may not set: the request has fields for
    the rendering ones (messages, add_generation_prompt, continue_final_message), the server chooses the template
    and how its text is encoded (`tokenize=False`, `tokenizer_kwargs` or `truncation` would change the encoding or
    what comes back, and `chat_template` would run a client's own Jinja). Tools and documents are what a template
    renders, so they pass. vLLM refuses `chat_template` and `tokenize` there too."""
    rendered = {"self", "kwargs", "tools", "documents"}
    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - rendered


def _encoding_options() -> frozenset[str]:
    """`apply_chat_template`'s arguments other than what it renders from: options of its encoding step (and any
    a later transformers adds, which then keep the chat off the cache)."""
    rendering = {"self", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "kwargs"}
    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - rendering


def _plain_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text -> ids with special-token text read as text, through a private copy of a fast tokenizer's backend
    (`backend_copy`): on the shared one, transformers' `split_special_tokens=True` would race with the other
    threads tokenizing requests (one could read a user's `<|im_end|>` as the token)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # a Python tokenizer: the option per call, no state
        return lambda text: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    plain = backend_copy(tokenizer, True)
    return lambda text: plain.encode(text, add_special_tokens=False).ids


def _replace_strings(value: Any, replace: Any) -> Any:
    """`value` with `replace` applied to every string in it (message text, tool-call arguments, names)."""
    if isinstance(value, str):
        return replace(value)
    if isinstance(value, dict):
        return {k: v if k == "role" else _replace_strings(v, replace) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_strings(v, replace) for v in value]
    return value
