"""Prompt text -> token ids with the leading text of long prompts remembered: requests that repeat a long system
prompt skip its tokenization (milliseconds a request on a small CPU) as the KV prefix cache skips its forward.

A text longer than MIN_CHARS is cut at the first safe point at or after every multiple of STRIDE characters, so
two texts that share a prefix cut it at the same places; each piece's ids are kept under a hash chain over the
text up to its cut, and the tail after the last cut is always encoded fresh. The result is exactly
`tokenizer.encode(text, add_special_tokens=False)`, by construction rather than by testing:

- Only tokenizers whose whole pipeline is recognised cut at all (`_recognised`): transformers' own fast
  tokenizer methods, a byte-level BPE without dropout, no normalizer or NFC, a pre-tokenizer of the GPT-2 /
  cl100k (Llama 3) / Qwen2 regex family, and post-processors that add nothing without special tokens. Any
  other tokenizer gets `tokenizer.encode` unchanged.
- A safe point i has an ASCII letter at i - 1, a single space at i, an ASCII letter at i + 1, and no added
  token's content within `reach` (the longest content plus one) of i. Then encode(t) == encode(t[:i]) +
  encode(t[i:]), stage by stage:
  * Added tokens are matched (leftmost-longest) before anything else, a match may swallow the whitespace beside
    it (lstrip / rstrip) and a single_word one looks at the characters beside it. No occurrence touches i - 1
    .. i + 1, so each lies wholly on one side, swallowing stops at the letters, and the characters beside an
    occurrence are on its own side: both halves extract what the whole does, and i falls inside one plain
    segment.
  * NFC never acts across the space: a space is in no canonical decomposition, and an ASCII letter is never
    the second character of one (so the letter before the space stays last in NFC(t[:i])). Only NFC tokenizers
    whose added tokens are all matched before normalization are recognised, so the match above is on raw text.
  * The regex (no anchors, no look-behind, the first alternative that matches wins): a letter is only ever
    matched by a contraction literal or by `\\p{L}+` after at most one leading character, and neither goes on
    past a space, so the match that holds the letter at i - 1 ends at i. A match attempt that starts before i
    reads position i only through `\\p{L}+` or a contraction's next letter, which a space fails exactly as the
    end of the text does; every other class (digits, punctuation, whitespace) stops at the letter at i - 1. So
    the matches before i are those of t[:i], and from i on the regex sees only t[i:] (the letter after the
    space is a margin the regex does not need).
  * ByteLevel maps each pre-token's bytes and BPE encodes each pre-token on its own.
  A point safe in t is safe in t[j:] for an earlier cut j (its window only shrinks, and i - 1 > j since t[j]
  is a space), so by induction the pieces' ids and the tail's concatenate to encode(t).
- A cached piece is returned only when its stored text equals the piece (the hash only finds it), and its ids
  were encoded from that text, so no collision can give wrong ids.

Pieces are encoded by a private copy of the tokenizer's backend (what transformers' `encode` runs), so no other
thread's per-call options (`split_special_tokens`) reach them. The tokenizer must not change after the cache is
made (tokens added later are neither in the copy nor in the window check).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

MIN_CHARS = 2048  # texts up to this long go straight to the tokenizer
STRIDE = 1024  # a cut at the first safe point at or after each multiple of this many characters

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_REGEX = CL100K_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
FAMILIES = {GPT2_REGEX: "gpt2", CL100K_REGEX: "cl100k", QWEN2_REGEX: "qwen2"}

_CANDIDATE = re.compile("[A-Za-z] [A-Za-z]")  # a safe point's characters; the added-token window is checked apart


class PromptTokens:
    """`encode(text)` == `tokenizer.encode(text, add_special_tokens=False)`, with the pieces of long texts
    remembered (least recently used first out, at most `max_pieces` pieces and `max_ids` ids). Thread-safe."""

    def __init__(self, tokenizer: Any, *, max_pieces: int = 4096, max_ids: int = 1 << 21) -> None:
        self.tokenizer = tokenizer
        self.max_pieces, self.max_ids = max_pieces, max_ids
        recognised = _recognised(tokenizer)
        self.family = recognised[0] if recognised else None  # None: every text goes straight to the tokenizer
        contents = recognised[1] if recognised else []
        self._added = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._reach = max(map(len, contents), default=0) + 1
        self._backend = backend_copy(tokenizer, bool(tokenizer.split_special_tokens)) if recognised else None
        self._pieces: OrderedDict[bytes, tuple[str, array]] = OrderedDict()
        self.ids_held = 0  # ids the pieces hold, all together
        self._lock = threading.Lock()
        self.fresh_chars = 0  # characters the tokenizer encoded (short texts, missed pieces, tails)
        self.cached_chars = 0  # characters whose ids came from the cache

    def encode(self, text: str) -> list[int]:
        """The ids of `text`: its pieces' from the cache where there, the rest from the tokenizer."""
        cuts = self.cuts(text)
        ids: list[int] = []
        key, start = b"", 0
        for cut in cuts:
            piece = text[start:cut]
            key = hashlib.blake2b(key + piece.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            ids += self._piece(key, piece)
            start = cut
        return ids + self._fresh(text[start:])

    def cuts(self, text: str) -> list[int]:
        """Where `text` is cut: the first safe point at or after each multiple of STRIDE (none for short texts or
        unrecognised tokenizers). A cut depends only on the text up to `reach` past it."""
        found: list[int] = []
        if self.family is None or len(text) <= MIN_CHARS:
            return found
        for offset in range(STRIDE, len(text), STRIDE):
            if found and found[-1] >= offset:
                continue
            cut = self._safe_point(text, offset)
            if cut is None:
                break
            found.append(cut)
        return found

    def _safe_point(self, text: str, start: int) -> int | None:
        """The first safe point at or after `start` (see the module's docstring)."""
        while (candidate := _CANDIDATE.search(text, start - 1)) is not None:
            cut = candidate.start() + 1
            if self._added is None or self._added.search(text, max(cut - self._reach, 0),
                                                         cut + self._reach + 1) is None:
                return cut
            start = cut + 1
        return None

    def _piece(self, key: bytes, piece: str) -> list[int]:
        with self._lock:
            held = self._pieces.get(key)
            if held is not None and held[0] == piece:
                self._pieces.move_to_end(key)
                self.cached_chars += len(piece)
                return list(held[1])
        ids = self._fresh(piece)
        with self._lock:
            old = self._pieces.pop(key, None)
            if old is not None:
                self.ids_held -= len(old[1])
            self._pieces[key] = (piece, array("I", ids))
            self.ids_held += len(ids)
            while len(self._pieces) > self.max_pieces or self.ids_held > self.max_ids:
                self.ids_held -= len(self._pieces.popitem(last=False)[1][1])
        return ids

    def _fresh(self, text: str) -> list[int]:
        with self._lock:
            self.fresh_chars += len(text)
        if self._backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self._backend.encode(text, add_special_tokens=False).ids

    def __len__(self) -> int:
        return len(self._pieces)


def backend_copy(tokenizer: Any, split_special_tokens: bool) -> Tokenizer:
    """A private copy of a fast tokenizer's backend, encoding as transformers' `encode` does (no truncation, no
    padding) with special-token text read as text or not once and for all: transformers sets such options on the
    shared backend for each call, which races with the other threads tokenizing requests."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = split_special_tokens
    return backend


def _recognised(tokenizer: Any) -> tuple[str, list[str]] | None:
    """(the pre-tokenizer's regex family, every added token's content) of a tokenizer that splits exactly at
    safe points; None for any other."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or not isinstance(tokenizer.backend_tokenizer, Tokenizer):
        return None
    # transformers' own text path: encode and chat templates call the backend on the text as it is, without
    # truncation or padding, and return its ids
    if any(getattr(type(tokenizer), name) is not getattr(PreTrainedTokenizerFast, name)
           for name in ("encode", "__call__", "_encode_plus", "apply_chat_template", "set_truncation_and_padding",
                        "_convert_encoding")):
        return None
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model, added = spec.get("model") or {}, spec.get("added_tokens") or []
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0.0):
        return None
    normalizer = spec.get("normalizer")
    if normalizer is not None and (normalizer != {"type": "NFC"} or any(t.get("normalized") for t in added)):
        return None
    if not _adds_nothing(spec.get("post_processor")):
        return None
    family = _family(spec.get("pre_tokenizer"))
    return (family, [t["content"] for t in added if t.get("content")]) if family else None


def _family(pre: Any) -> str | None:
    """ByteLevel with its built-in GPT-2 regex, or one of the known regexes split off (isolated) before a
    ByteLevel without its own; never with a prefix space (it would change a piece's first word). Any setting
    beyond these (offsets aside) is unknown, so not recognised."""
    if not isinstance(pre, dict):
        return None
    if _without_offsets(pre) == {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}:
        return "gpt2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2 or not all(isinstance(step, dict) for step in steps):
        return None
    split, level = steps
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    if (split != {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
            or _without_offsets(level) != {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}):
        return None
    return FAMILIES.get(regex)


def _without_offsets(step: dict) -> dict:
    return {key: value for key, value in step.items() if key != "trim_offsets"}


def _adds_nothing(post: Any) -> bool:
    """Post-processors that leave the ids alone when no special tokens are added (only offsets change)."""
    if post is None:
        return True
    if post.get("type") == "Sequence":
        return all(map(_adds_nothing, post.get("processors") or []))
    return post.get("type") in ("ByteLevel", "TemplateProcessing")
