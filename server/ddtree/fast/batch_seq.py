"""A batched sequence's state between steps, and its own picks: the argmax of every plainly greedy row at once,
and each other sequence's processors, sampler and grammar applied node by node along its own path."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ddtree.core import grammar
from ddtree.core.rounds import DecodeRequest
from ddtree.core.sampling import History, pick_tokens, process_logits, token_logprobs
from ddtree.core.tree import DraftTree
from ddtree.fast.batch_trees import RoundTrees
from ddtree.kernels.tree import vocab_argmax


@dataclass
class SeqState:
    """What the backend keeps of one sequence between steps."""

    request: DecodeRequest
    start: int = 0  # context rows in both caches
    root: int | None = None  # the last emitted token, not cached yet
    generator: torch.Generator | None = None
    history: History | None = None
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks' raw logits, for prompt logprobs
    scores: np.ndarray | None = None  # its last device round's tree: node log-probabilities, best first


def plain_greedy(state: SeqState) -> bool:
    """Whether the sequence's picks are its rows' argmax (no processor, penalty, bias or grammar changes them)."""
    params = state.request.params
    return params.greedy and not params.penalized and not params.logit_bias and state.request.constraint is None


def plain_sampled(state: SeqState) -> bool:
    """Whether the sequence samples with its temperature and filters alone: no processor, penalty, bias or grammar,
    and no seed (a seeded request draws from its own generator, so that its output repeats)."""
    params, request = state.request.params, state.request
    return (not params.greedy and params.seed is None and not params.penalized and not params.logit_bias
            and request.constraint is None)


def round_picks(states: list[SeqState], trees: RoundTrees, logits: torch.Tensor,
                offsets: list[int]) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
    """Every row's pick: the argmax of every row in one launch and one copy where some sequence picks plainly
    greedily; each other sequence's own (its processors, sampler and grammar, node by node). Returns the
    picks and, per such sequence, its processed logits (for its logprobs)."""
    picks = np.zeros(offsets[-1], dtype=np.int64)
    plain = [plain_greedy(state) for state in states]
    if any(plain):
        picks[:] = vocab_argmax(logits).cpu().numpy()
    processed = {}
    for r, state in enumerate(states):
        if not plain[r]:
            lo, hi = offsets[r], offsets[r + 1]
            processed[r], own = tree_picks(state, trees.tree(r), logits[lo:hi])
            picks[lo:hi] = own
    return picks, processed


def tree_picks(state: SeqState, tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The sequence's own picks at each of its nodes, its processors applied to each node for its own path."""
    pending = [[tree.tokens[j - 1] for j in tree.path_to(i)[1:]] for i in range(tree.size + 1)]
    processed = processed_logits(state, logits, pending)
    return processed, pick_tokens(processed, state.request.params, state.generator).tolist()


def processed_logits(state: SeqState, logits: torch.Tensor, pending: list[list[int]]) -> torch.Tensor:
    """The rows' logits after the sequence's grammar and processors, each row after its own pending tokens."""
    request = state.request
    if request.constraint is not None:
        logits = grammar.mask_logits(logits, request.constraint.allowed(pending))
    return process_logits(logits, request.params, state.history.rows(pending) if state.history else None)


def logprob_rows(state: SeqState, processed: torch.Tensor,
                 tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The emitted tokens' logprobs and the top ones, where the request asks for them."""
    k = state.request.params.logprobs
    if k is None:
        return None
    return token_logprobs(processed, torch.tensor(tokens, device=processed.device), k)
