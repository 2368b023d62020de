"""Sampling parameters and the per-node logits processing shared by every decoding method.

Every token the engine emits is a pick from the *target's* processed distribution at the node where it
was emitted, so `ar`, `dflash` and `ddtree` share exactly this code: that is what makes them lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


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

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to rows of raw logits [N, V]; returns float32 logits.

    Filtered entries become -inf. Greedy requests get the raw logits: argmax is unaffected by the
    filters, and reported logprobs are then the model's own distribution.
    """
    out = logits.float()
    if params.greedy:
        return out
    out = out / params.temperature
    vocab = out.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(out, params.top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


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


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator when a seed is given (CPU generator: same draws on every device)."""
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(params.seed)
    return gen
