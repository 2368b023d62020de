"""The reference path: `ar`, `dflash` and `ddtree` rounds in plain PyTorch over transformers' own forward.

The oracle the fast path is tested against, and the path for whatever the fast path declines (CPU runs,
sliding windows, budgets beyond its largest tree). Each round: draft -> tree -> verify -> commit.

    draft   the DFlash block pass over the drafter's context cache -> per-depth logits
    tree    the best-first DDTree (or the draft's argmax chain for `dflash`, nothing for `ar`)
    verify  one target forward over root + tree with the ancestor-only mask; every node gets the target's
            own pick (processed for the request: grammar mask, bias, penalties with the node's own path,
            temperature and filters), and the walk follows the picks from the root while they match a child
    commit  keep the accepted path's K/V (and a hybrid's recurrent state), extend the draft's context

The emitted tokens are the picks along the accepted path, so every method emits what the target alone would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from ddtree.core import grammar
from ddtree.core.rounds import PHASES, DecodeRequest, Round
from ddtree.core.sampling import History, SamplingParams, make_generator, pick_tokens, process_logits, token_logprobs
from ddtree.core.tree import DraftTree, Transitions, build_selector_tree, build_tree, chain_tree, selector_chain, walk
from ddtree.models.draft import DFlashDraft, DraftCache
from ddtree.models.draft_vocab import DraftHead
from ddtree.models.target import Target


class ReferenceBackend:
    """Rounds for one request at a time over a target (and its drafter): any request, any device."""

    name = "reference"

    def __init__(self, target: Target, draft: DFlashDraft | None, draft_head: DraftHead | None) -> None:
        self.target, self.draft, self.draft_head = target, draft, draft_head
        self.block_size = draft.config.block_size if draft is not None else 1

    def accepts(self, request: DecodeRequest) -> bool:
        return True

    @torch.inference_mode()
    def rounds(self, request: DecodeRequest) -> Iterator[Round]:
        params, target = request.params, self.target
        draft = self.draft if request.method != "ar" else None
        device = target.device
        generator = make_generator(params, device)
        cache = target.new_cache()
        draft_cache = DraftCache(len(draft.layers)) if draft is not None else None
        history = History(request.prompt_ids, target.shape.vocab_size, device) if params.penalized else None
        constraint = request.constraint
        max_context = target.max_context

        t0 = self._now()
        prompt = torch.tensor(request.prompt_ids, device=device)
        every_row = params.prompt_logprobs is not None
        logits, taps = target.forward(prompt, torch.arange(len(prompt), device=device), cache,
                                      logits_rows=None if every_row else 1)
        prompt_logits = logits if every_row else None
        logits = logits[-1:]
        if constraint:
            logits = grammar.mask_logits(logits, constraint.allowed([[]]))
        processed = process_logits(logits, params, history.rows([[]]) if history else None)
        root = int(pick_tokens(processed, params, generator)[0])
        if draft is not None:
            draft.extend_context(draft_cache, taps[None], torch.arange(len(prompt), device=device)[None])
        if history:
            history.add([root])
        start = len(prompt)  # position of the root = number of tokens in the target cache
        yield Round([root], 0, 0, {"prefill": self._now() - t0}, self._logprob_rows(processed, [root], params),
                    prompt_logits, is_prefill=True)
        while True:
            phases = dict.fromkeys(PHASES, 0.0)
            t = self._now()
            max_depth = min(self.block_size - 1, max_context - 1 - start)
            draft_logits = self._draft(root, start, draft_cache) if draft is not None and max_depth > 0 else None
            phases["draft"], t = self._lap(t)
            tree = self._tree(request, draft_logits, max_depth)
            ids = torch.tensor([root, *tree.tokens], device=device)
            positions = torch.tensor([0, *tree.depths], device=device) + start
            phases["tree"], t = self._lap(t)
            logits, taps = target.forward(ids, positions, cache, tree=tree)
            rows = None
            if history or constraint:  # each node: the emitted tokens plus its own path below the root
                pending = [[tree.tokens[j - 1] for j in tree.path_to(i)[1:]] for i in range(tree.size + 1)]
                rows = history.rows(pending) if history else None
                if constraint:
                    logits = grammar.mask_logits(logits, constraint.allowed(pending))
            processed = process_logits(logits, params, rows)
            picks = pick_tokens(processed, params, generator).tolist()
            path = walk(tree, picks)
            emitted = [picks[node] for node in path]
            phases["verify"], t = self._lap(t)
            target.compact(cache, start, path)
            if draft is not None:
                path_idx = torch.tensor(path, device=device)
                draft.extend_context(draft_cache, taps[path_idx][None], positions[path_idx][None])
            if history:
                history.add(emitted)
            start += len(path)
            root = emitted[-1]
            phases["commit"], _ = self._lap(t)
            yield Round(emitted, tree.size, len(path) - 1, phases,
                        self._logprob_rows(processed[path], emitted, params))

    def _draft(self, root: int, start: int, draft_cache: DraftCache) -> torch.Tensor | Transitions:
        """The drafter's logits for the next block_size - 1 positions after the root (over its draft vocabulary), or
        a DFlash2 drafter's transition model over them."""
        device = self.target.device
        block = torch.full((self.block_size,), self.draft.config.mask_token_id, device=device)
        block[0] = root
        embeds = self.target.embed_tokens(block)[None]
        hidden = self.draft(embeds, torch.arange(start, start + self.block_size, device=device)[None],
                            cache=draft_cache)
        return self.draft.propose(hidden[0, 1:], self.draft_head, self.draft_head.token_ids, root)

    def _tree(self, request: DecodeRequest, draft_logits: torch.Tensor | Transitions | None,
              max_depth: int) -> DraftTree:
        if draft_logits is None:
            return DraftTree()
        if isinstance(draft_logits, Transitions):  # DFlash2: its selector's chain, or the tree over its transitions
            model = draft_logits.first(max_depth)
            if request.method == "dflash":
                return chain_tree(selector_chain(model))
            return build_selector_tree(model, request.budget)
        draft_logits = draft_logits[:max_depth]
        head = self.draft_head
        if request.method == "dflash":
            return chain_tree(head.tokens(draft_logits.argmax(dim=-1)).tolist())
        return build_tree(draft_logits, request.budget, token_ids=head.token_ids)

    @staticmethod
    def _logprob_rows(processed: torch.Tensor, tokens: list[int],
                      params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`token_logprobs` of the tokens emitted from processed rows [n, V], when the request asks for them."""
        if params.logprobs is None:
            return None
        return token_logprobs(processed, torch.tensor(tokens, device=processed.device), params.logprobs)

    def _now(self) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _lap(self, t: float) -> tuple[float, float]:
        now = self._now()
        return now - t, now
