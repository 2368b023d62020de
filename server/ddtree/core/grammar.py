"""Structured outputs: a request's JSON schema as a token-level constraint, per tree node (llguidance).

A constrained request decodes from the target's distribution restricted, at every step, to the tokens that
keep the output a valid prefix of the grammar (what vLLM does for `response_format`). DDTree stays
lossless under it the same way it does under penalties: each tree node is masked for the state its own
path below the root would leave the grammar in, so a node is accepted exactly when constrained AR would
have picked its token. The drafter is not constrained; invalid proposals are simply never accepted. A
reply that thinks first is free until its think block closes, and the grammar applies after it (vLLM with
a reasoning parser); again per node, each path crossing the close at its own depth.

llguidance (a small Rust library with no dependencies) computes the masks from the tokenizer's vocabulary
on the host: 0.9 ms for a 65-node tree over the demo's 8192-token vocabulary on a 2-core CPU. They stay in
llguidance's packed layout (one bit per token) until they reach the logits' device: a 65-node tree's masks
over a 152k vocabulary are 1.2 MB packed and 10 MB as bools; unpacking them row by row on the host took
2.1 ms on a 2-core CPU (numpy's unpackbits: 0.4 ms; on a GPU the verify graph unpacks them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ddtree.core.sampling import ThinkBlock
from ddtree.errors import DDTreeError

try:
    import llguidance
    import llguidance.hf
except ImportError:  # an install without the server extra: constrained requests are refused
    llguidance = None

JSON_OBJECT: dict[str, Any] = {"type": "object"}  # `response_format: json_object`: any JSON object
# JSON laid out as json.dumps writes it: free whitespace lets a sampled model pad an object forever (seen
# with the demo pair at temperature 1). A schema's own "x-guidance" settings take precedence.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Where a constrained reply with a think block stands: before its first token, inside the block, under the grammar.
START, THINK, GRAMMAR = "start", "think", "grammar"


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar (a JSON string) for outputs matching `schema`; ValueError with the reason
    when the schema is not one it can compile."""
    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be an object")
    try:
        return _checked(_matcher().grammar_from_json_schema(json.dumps(schema), defaults=LAYOUT))
    except ValueError as exc:
        raise ValueError(str(exc).replace("unsupported grammar", "unsupported JSON schema")) from None


def regex_grammar(pattern: str) -> str:
    """The llguidance grammar for outputs matching the whole regular expression `pattern` (Rust syntax)."""
    return _checked(_matcher().grammar_from_regex(pattern))


def choice_grammar(options: list[str]) -> str:
    """The llguidance grammar for outputs equal to one of `options`."""
    if not options or not all(isinstance(o, str) and o for o in options):
        raise ValueError("the choices must be a non-empty list of non-empty strings")
    return lark_grammar("start: " + " | ".join(json.dumps(o) for o in options))


def lark_grammar(source: str) -> str:
    """The llguidance grammar for a Lark grammar (which may embed JSON schemas as `%json {...}`); ValueError
    with the reason when it does not compile."""
    return _checked(_matcher().grammar_from_lark(source))


def _matcher() -> Any:
    if llguidance is None:
        raise DDTreeError("structured outputs need llguidance: pip install 'ddtree[server]'")
    return llguidance.LLMatcher


def _checked(grammar: str) -> str:
    error = _matcher().validate_grammar(grammar, None)
    if error:  # llguidance points at the spot with caret lines and a source excerpt: keep the words
        words = [line.strip() for line in error.splitlines()
                 if line.strip() and set(line.strip()) != {"^"} and not re.match(r"\s*\d+ \|", line)]
        raise ValueError("unsupported grammar: " + " ".join(words))
    return grammar


class Constraint:
    """One request's grammar state over emitted tokens, and the masks a round's tree nodes need.

    With a `think` block the grammar waits for it: while a path is inside the block every token is allowed,
    and the grammar reads only the tokens after its close. A reply the prompt did not open a block for may
    open one with its first token only (the reasoning parser, too, only takes a block at the reply's start);
    any other first token starts the grammar.
    """

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int, think: ThinkBlock | None = None) -> None:
        """`tokenizer` is `grammar_tokenizer`'s view of the model's tokenizer."""
        self.vocab_size = vocab_size
        self.think = think
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise DDTreeError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self._phase = GRAMMAR if think is None else THINK if think.opened else START  # of the emitted tokens

    def _after(self, tokens: Sequence[int]) -> tuple[str, list[int]]:
        """(the phase after the emitted tokens plus `tokens`, those of `tokens` the grammar reads): only the
        tail after the think block, so a path's thinking is never fed to the matcher."""
        phase, tokens = self._phase, list(tokens)
        if phase == START and tokens:
            phase, tokens = (THINK, tokens[1:]) if tokens[0] == self.think.open else (GRAMMAR, tokens)
        if phase == THINK and self.think.close in tokens:
            phase, tokens = GRAMMAR, tokens[tokens.index(self.think.close) + 1:]
        return phase, tokens if phase == GRAMMAR else []

    def allowed(self, pending: Sequence[Sequence[int]]) -> torch.Tensor:
        """Per row, the next tokens the grammar allows after the emitted tokens plus the row's own tokens
        not emitted yet (a tree node's path below the root), packed: int32 [N, words] (see `unpack`). A row
        whose path already breaks the grammar can never be accepted (its parent's row forbids it); it allows
        everything, as does a row inside the think block."""
        bits = torch.full((len(pending), words(self.vocab_size)), -1, dtype=torch.int32)
        for i, path in enumerate(pending):
            phase, tokens = self._after(path)
            if phase == THINK:
                continue
            consumed = self.matcher.try_consume_tokens(tokens) if tokens else 0
            if consumed == len(tokens):
                self.matcher.unsafe_compute_mask_ptr(bits[i].data_ptr(), bits.shape[1] * 4)
                if phase == START:  # the reply may open its think block instead
                    bits[i].view(torch.uint8)[self.think.open // 8] |= 1 << self.think.open % 8
            if consumed:
                self.matcher.rollback(consumed)
        return bits

    def consume(self, tokens: Sequence[int]) -> None:
        """Tokens just emitted, each allowed by the mask it was picked under (past the grammar's end only an
        end-of-sequence token can follow, which `ignore_eos` keeps in the output)."""
        self._phase, tokens = self._after(tokens)
        if tokens and self.matcher.try_consume_tokens(tokens) != len(tokens) and not self.matcher.is_stopped():
            raise DDTreeError(f"emitted tokens broke the grammar: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the output is whole)."""
        return self._phase == GRAMMAR and self.matcher.is_stopped()


def words(vocab_size: int) -> int:
    """int32 words of one packed mask row."""
    return (vocab_size + 31) // 32


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Raw logits [N, V] with the tokens the packed masks `allowed` [N, words] forbid at -inf (before any
    other processing, as vLLM); unchanged without masks."""
    if allowed is None:
        return logits
    return logits.masked_fill(~unpack(allowed.to(logits.device, non_blocking=True), logits.shape[-1]), float("-inf"))


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed masks int32 [N, words] (bit j of word w is token 32 w + j) -> bool [N, vocab_size],
    on their own device: bit operations on a GPU (they run inside the fast path's verify graph), numpy's
    unpackbits on the host."""
    little = bits.contiguous().view(torch.uint8)  # little-endian: byte b of word w holds tokens 32 w + 8 b ..
    if little.device.type == "cpu":
        unpacked = torch.from_numpy(np.unpackbits(little.numpy(), axis=-1, bitorder="little")).view(torch.bool)
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=little.device)
        unpacked = ((little.unsqueeze(-1) >> shifts) & 1).flatten(1).view(torch.bool)
    return unpacked[:, :vocab_size]


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a Hugging Face tokenizer over the model's `vocab_size` ids (it walks the whole
    vocabulary: build it once per engine)."""
    _matcher()
    if tokenizer is None:
        raise DDTreeError("structured outputs need the model's tokenizer")
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
