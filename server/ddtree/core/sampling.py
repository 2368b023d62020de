"""Sampling parameters and the per-node logits processing shared by every decoding method.

Every token the engine emits is a pick from the *target's* processed distribution at the node where it
was emitted, so `ar`, `dflash` and `ddtree` share exactly this code: that is what makes them lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's limit)


@dataclass(frozen=True)
class ThinkBlock:
    """Under a grammar, the think block a reply may write first, unconstrained: the grammar applies from the
    token after `close` (vLLM's structured outputs with a reasoning parser). `opened`: the prompt opened the
    block, so the reply starts inside it; else the reply may open it with `open` as its first token."""

    open: int
    close: int
    opened: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of decoding. temperature 0 means greedy (argmax)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or negative: off
    seed: int | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the chosen token only; k: plus the top-k alternatives
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this per earlier generation of the token
    repetition_penalty: float = 1.0  # HF's / vLLM's: tokens of the prompt or output, positive logits / r, negative * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: str | None = None  # structured output (ddtree.grammar): only tokens that keep it valid
    think: ThinkBlock | None = None  # under the grammar: a think block before it applies
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's log-probability and top-k

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a token's logit depends on the tokens before it (so each tree node needs its own history)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class History:
    """What the penalties look at, on the device: how often each token was generated, and which tokens
    appeared in the prompt or the output."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True

    def add(self, tokens: Sequence[int]) -> None:
        """Tokens just emitted."""
        if tokens:
            ids = torch.tensor(list(tokens), dtype=torch.long, device=self.counts.device)
            self.counts.index_put_((ids,), torch.ones(len(ids), device=ids.device), accumulate=True)
            self.seen[ids] = True

    def rows(self, pending: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, this history plus the row's own tokens not emitted yet (a tree node's path below the
        root): (counts [N, V], seen [N, V])."""
        n = len(pending)
        counts, seen = self.counts.expand(n, -1).clone(), self.seen.expand(n, -1).clone()
        rows = [i for i, tokens in enumerate(pending) for _ in tokens]
        if rows:
            index = (torch.tensor(rows, device=counts.device),
                     torch.tensor([t for tokens in pending for t in tokens], device=counts.device))
            counts.index_put_(index, torch.ones(len(rows), device=counts.device), accumulate=True)
            seen[index] = True
        return counts, seen


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   history: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Apply logit bias, penalties (given each row's `History.rows`), temperature, min-p, top-k and top-p
    to rows of raw logits [N, V], in vLLM's order; returns float32 logits.

    Filtered entries become -inf. Greedy requests stop after the penalties: argmax is unaffected by the
    filters, and reported logprobs are then the (biased, penalized) model's own distribution.
    """
    out = logits.float()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        out[:, list(ids)] += torch.tensor(bias, device=out.device)
    if params.penalized:
        out = apply_penalties(out, *history, params.repetition_penalty, params.frequency_penalty,
                              params.presence_penalty)
    if params.greedy:
        return out
    return filter_logits(out / params.temperature, params.top_k, params.top_p, params.min_p)


def apply_penalties(out: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, repetition: float | torch.Tensor,
                    frequency: float | torch.Tensor, presence: float | torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on float32 logits [N, V]: the repetition penalty over the tokens `seen` (prompt and
    output), then frequency and presence over the output's token `counts`. (The fast path passes the values
    as device scalars, so one captured graph serves every setting.)"""
    out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    return out - frequency * counts - presence * (counts > 0).float()


def filter_logits(out: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Min-p, then top-k, then top-p over temperature-scaled logits [N, V]; filtered entries become -inf.
    (The fast path runs this same function inside its sampled graphs.)

    Top-p keeps the most probable tokens until the mass before the next one reaches top_p (the first always
    stays), and every token tied with the last one kept. After top-k, the k values torch.topk returned
    already rank the survivors, so top-p needs no sort of the vocabulary: on a GPU that sort was most of
    what top-p cost.
    """
    if min_p > 0:
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    ranked = None  # descending values holding every finite entry's rank, when known
    if 0 < top_k < out.shape[-1]:
        ranked = torch.topk(out, top_k, dim=-1).values
        out = out.masked_fill(out < ranked[..., -1:], float("-inf"))
    if top_p < 1.0:
        if ranked is None:
            ranked = torch.sort(out, dim=-1, descending=True).values
        probs = torch.exp(ranked - torch.logsumexp(out, dim=-1, keepdim=True))
        kept = (torch.cumsum(probs, dim=-1) - probs < top_p).sum(dim=-1, keepdim=True)  # a prefix of the ranking
        out = out.masked_fill(out < ranked.gather(-1, (kept - 1).clamp(min=0)), float("-inf"))
    return out


def filter_floor(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, cap: int) -> torch.Tensor:
    """filter_logits as one number a row, for rows that each have their own settings (the batch's device round):
    the least logit the row keeps, so that `logits >= floor` is what filter_logits keeps of `logits / T`. A floor
    on the logits themselves, not the scaled ones, so that a kernel that scales them its own way keeps the same
    tokens. Each row's top `cap` logits are ranked once; a row's top-k is at most `cap`, and its top-p < 1 needs
    a top-k (the nucleus then lies inside the ranked ones). Every filter keeps by value, as filter_logits does, so
    the tokens tied with the top-k's last one that rank past `cap` are counted and kept too (the top-p's mass
    counts them). logits [N, V]; temperature (> 0), top_k (0: off), top_p, min_p: [N]; returns float32 [N]."""
    raw = logits.topk(min(cap, logits.shape[1]), dim=-1).values.float()
    ranked = raw / temperature[:, None]  # the scaled logits' own ranking: dividing by T > 0 keeps the order
    none = torch.full_like(raw[:, 0], float("-inf"))
    floor = torch.where(min_p > 0, raw[:, 0] + temperature * torch.log(min_p), none)  # p >= min_p x the top p
    kth = raw.gather(1, (top_k - 1).clamp(0, raw.shape[1] - 1)[:, None])[:, 0]
    floor = torch.where(top_k > 0, torch.maximum(floor, kth), floor)
    kept = raw >= floor[:, None]
    past_cap = (logits >= floor[:, None]).sum(dim=-1) - kept.sum(dim=-1)  # ties of the last ranked, if any
    weights = torch.where(kept, torch.exp(ranked - ranked[:, :1]), 0.0)
    mass = weights.sum(dim=-1) + past_cap * torch.exp(ranked[:, -1] - ranked[:, 0])
    probs = weights / mass[:, None]
    nucleus = ((torch.cumsum(probs, dim=-1) - probs < top_p[:, None]) & kept).sum(dim=-1)
    last = raw.gather(1, (nucleus - 1).clamp(min=0)[:, None])[:, 0]
    return torch.where(top_p < 1.0, torch.maximum(floor, last), floor)


def pick_tokens(
    processed: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One independent pick per row of processed logits [N, V] -> token ids [N]."""
    if params.greedy:
        return processed.argmax(dim=-1)
    probs = torch.softmax(processed, dim=-1)
    if generator is not None and generator.device != probs.device:
        # Draw on the generator's device so a seeded request is reproducible across devices.
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def token_logprobs(processed: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities under processed logits [n, V] of the token each row emitted (tokens [n]) and of the
    row's k best: (values [n, 1 + k], float32: the token's, then the k best; ids [n, k]). Computed where the
    logits are, so the fast path hands the host a few numbers per token instead of vocabulary-wide rows."""
    logp = torch.log_softmax(processed.float(), dim=-1)
    top_values, top_ids = logp.topk(k, dim=-1)
    return torch.cat([logp.gather(1, tokens[:, None]), top_values], dim=1), top_ids


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator when a seed is given (CPU generator: same draws on every device)."""
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(params.seed)
    return gen
