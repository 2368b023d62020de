"""Draft vocabularies: the tokens the drafter may propose, and the LM head rows it scores them with.

A DFlash drafter scores its block with the target's LM head: on Qwen3 that is 151936 rows, 1.24 GB in
bf16, a third of everything a round reads outside the verify. Text uses few of those tokens most of the
time, so the drafter can score only the most frequent ones (as FR-Spec and SGLang's
`--speculative-token-map` do). That never changes the output: the target verifies every node and picks
every emitted token from its own full distribution; a token outside the draft vocabulary is still
emitted, as the bonus token of its round. It only changes which trees are drafted, so it trades a little
acceptance for a cheaper draft step.

A draft vocabulary file is JSON, written by `ddtree draft-vocab` (`token_ids`, most frequent first, plus
how they were counted), or a plain JSON list of ids, or a `.pt` file holding a 1-D tensor of ids (SGLang's
hot-token maps).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from ddtree.errors import DDTreeError
from ddtree.kernels.fp8 import Fp8Weight
from ddtree.models.quantize import head_logits, head_rows

FORMAT = "ddtree-draft-vocab"


def most_frequent(counts: torch.Tensor, size: int, keep: Iterable[int] = ()) -> list[int]:
    """The `size` token ids to draft from: every id in `keep` (stop tokens: drafting them lets a round end a
    generation), then the most counted ids, ties to the lower id, then the lowest uncounted ids if the counts
    name too few (BPE vocabularies number tokens roughly by merge order, so by frequency). Most frequent first.
    """
    vocab = counts.numel()
    if not 1 <= size <= vocab:
        raise DDTreeError(f"the draft vocabulary size must be in 1..{vocab}, got {size}")
    keep = list(dict.fromkeys(int(t) for t in keep if 0 <= int(t) < vocab))[:size]
    # Stable sort on descending counts: equal counts stay in id order.
    ranked = torch.sort(counts.double(), descending=True, stable=True).indices.tolist()
    chosen = dict.fromkeys(keep)
    for token in ranked:
        if len(chosen) == size:
            break
        chosen.setdefault(token)
    return list(chosen)


def count_tokens(streams: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the token streams (int64 [vocab_size])."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in streams:
        ids = ids.long().flatten()
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
            raise DDTreeError(f"token ids must be in [0, {vocab_size})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def write_draft_vocab(path: str | Path, token_ids: Sequence[int], vocab_size: int, **about: object) -> None:
    """A draft vocabulary file: the ids (most frequent first), the target vocabulary they index, and `about`
    (what was counted)."""
    Path(path).write_text(json.dumps({"format": FORMAT, "vocab_size": vocab_size, **about,
                                      "token_ids": [int(t) for t in token_ids]}) + "\n")


def load_draft_vocab(path: str | Path, vocab_size: int) -> list[int]:
    """The token ids a draft vocabulary file names (any order), checked against the target's vocabulary."""
    ids, counted_for = read_draft_vocab(path)
    return check_draft_vocab(ids, counted_for, vocab_size, path)


def read_draft_vocab(path: str | Path) -> tuple[list[int], int | None]:
    """A draft vocabulary file's token ids and the vocabulary size it was counted for (None when it does not
    say), checked for what needs no target: read before a model loads, so a bad file fails at once."""
    path = Path(path)
    if not path.is_file():
        raise DDTreeError(f"draft vocabulary {path} does not exist")
    counted_for = None
    if path.suffix == ".pt":
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many kinds for a bad file; all mean the same
            raise DDTreeError(f"draft vocabulary {path} is not a torch file of token ids: {exc}") from None
        ids = data.flatten().tolist() if isinstance(data, torch.Tensor) else data
    else:
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DDTreeError(f"draft vocabulary {path} is not JSON: {exc}") from None
        if isinstance(data, dict):
            counted_for, data = data.get("vocab_size"), data.get("token_ids")
        ids = data
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DDTreeError(f"draft vocabulary {path} must hold a non-empty list of token ids")
    if len(set(ids)) != len(ids):
        raise DDTreeError(f"draft vocabulary {path} names a token id twice")
    return ids, counted_for


def check_draft_vocab(ids: list[int], counted_for: int | None, vocab_size: int, path: str | Path) -> list[int]:
    """`ids` of the file at `path`, once they are known to index the target's vocabulary of `vocab_size`."""
    if counted_for is not None and counted_for != vocab_size:
        raise DDTreeError(f"draft vocabulary {path} was counted for a vocabulary of {counted_for} tokens; "
                          f"the target has {vocab_size}")
    if not all(0 <= t < vocab_size for t in ids):
        raise DDTreeError(f"draft vocabulary {path} holds token ids outside [0, {vocab_size})")
    return ids


class DraftHead:
    """The LM head the drafter scores its block with: the target's, or its rows of a draft vocabulary.

    With a vocabulary, column c of the draft's logits is token `token_ids[c]` (ids ascending, so ties between
    draft tokens still go to the lower token id, as with the whole vocabulary). The rows are a copy: a
    contiguous weight streams at full bandwidth, where gathering rows every round would not. A quantized
    drafter (`quantization` "fp8", ddtree.quantize) scores with an fp8 copy of the rows.
    """

    def __init__(self, lm_head: nn.Linear, token_ids: Sequence[int] | None = None,
                 quantization: str | None = None) -> None:
        weight, bias = lm_head.weight.detach(), None if lm_head.bias is None else lm_head.bias.detach()
        self.token_ids: torch.Tensor | None = None
        if token_ids is not None and len(token_ids) < weight.shape[0]:
            ids = torch.tensor(sorted(token_ids), dtype=torch.long, device=weight.device)
            weight, bias = weight.index_select(0, ids), None if bias is None else bias.index_select(0, ids)
            self.token_ids = ids
        self.weight: torch.Tensor | Fp8Weight = head_rows(weight, quantization)
        self.bias = bias

    @property
    def size(self) -> int:
        """Tokens the drafter can propose."""
        return self.weight.shape[0]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(hidden, self.weight, self.bias)

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-logit columns."""
        return columns if self.token_ids is None else self.token_ids[columns]
