"""One request's decoding loop: the rounds a backend yields, turned into what the request emits.

The loop is the same for every backend and method: cut each round at the first stop id or the token limit,
feed the emitted tokens to the grammar (a finished grammar ends the request), attach log-probabilities, end
the request when the context is full, and keep the statistics. The backend (the reference path or the fast
path) decides nothing a client sees: it only proposes and verifies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from ddtree.core.rounds import PHASES, Backend, DecodeRequest, Round


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # best first
    rank: int | None = None  # the token's rank in its distribution (1: the most likely); prompt tokens only


@dataclass
class RoundOutput:
    """What one target forward (or the prefill) emitted."""

    token_ids: list[int]  # emitted tokens, cut at EOS / stop id (never included) / max_new_tokens
    logprobs: list[TokenLogprob] | None
    draft_nodes: int  # tree nodes verified, root excluded
    accepted: int  # accepted draft tokens, bonus excluded (= depth of the deepest accepted node)
    phase_seconds: dict[str, float]
    finish_reason: str | None = None  # None while going on; "stop" or "length"
    stop_token_id: int | None = None
    is_prefill: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prefill's, when asked for (first: None)


@dataclass
class GenerationStats:
    method: str
    budget: int
    block_size: int
    prompt_tokens: int
    rounds: int = 0  # verify forwards after the prefill
    generated_tokens: int = 0
    committed_tokens: int = 0  # tokens committed by verify rounds incl. bonus (before any stop cut)
    accepted_per_depth: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """τ: tokens committed per verify forward, bonus included."""
        return self.committed_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the prefill's, over decode time."""
        decoded = max(self.generated_tokens - 1, 0)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def record_round(self, committed: int, phase_seconds: dict[str, float]) -> None:
        """One verify round: `committed` tokens, bonus included, and its phases."""
        self.rounds += 1
        self.committed_tokens += committed
        for d in range(committed - 1):
            self.accepted_per_depth[d] += 1
        for name, seconds in phase_seconds.items():
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def to_dict(self) -> dict:
        out = asdict(self)
        out["acceptance_length"] = round(self.acceptance_length, 4)
        out["tokens_per_second"] = round(self.tokens_per_second, 2)
        return out


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    stop_token_id: int | None
    logprobs: list[TokenLogprob] | None
    stats: GenerationStats


class Generation:
    """One request's decoding: iterate for RoundOutputs; close() stops early and frees the backend's state.

    Given a `backend`, the generation pulls its rounds itself (one request at a time: `Engine.stream`); without
    one, a batch engine runs the rounds and hands each to `take` (engine/batch.py)."""

    def __init__(self, request: DecodeRequest, backend: Backend | None, *, block_size: int, max_context: int,
                 eos_token_ids: set[int]) -> None:
        self.request, self.backend = request, backend
        self.prompt_ids, self.params = request.prompt_ids, request.params
        self.method, self.budget = request.method, request.budget
        self.max_context = max_context
        depth = block_size - 1
        self.stats = GenerationStats(method=self.method, budget=self.budget if self.method == "ddtree" else depth,
                                     block_size=block_size, prompt_tokens=len(self.prompt_ids),
                                     accepted_per_depth=[0] * depth)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._stop_ids = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else eos_token_ids)
        self._rounds = backend.rounds(request) if backend is not None else None
        self._decode_start: float | None = None

    def __iter__(self) -> Iterator[RoundOutput]:
        return self

    def __next__(self) -> RoundOutput:
        if self.finish_reason is not None:
            raise StopIteration
        if self._rounds is None:
            raise TypeError("this generation's rounds come from a batch engine (BatchEngine.step)")
        return self.take(next(self._rounds))

    def close(self) -> None:
        if self._rounds is not None:
            self._rounds.close()

    def take(self, raw: Round) -> RoundOutput:
        """Turn a backend's round into what this request emits, and account for it."""
        kept, stop_id = self._cut(raw.tokens)
        logprobs = self._logprobs(raw.logprob_rows, kept) if self.params.logprobs is not None else None
        self.token_ids.extend(kept)
        self.stats.generated_tokens = len(self.token_ids)
        out = RoundOutput(kept, logprobs, raw.nodes, raw.accepted, raw.phase_seconds, None, stop_id, raw.is_prefill)
        if raw.prompt_logits is not None:
            out.prompt_logprobs = self._prompt_logprobs(raw.prompt_logits, self.params.prompt_logprobs or 0)
        constraint = self.request.constraint
        if constraint is not None:
            constraint.consume(kept)
            if constraint.finished and self.finish_reason is None:  # whole, and nothing more allowed (not even EOS)
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.prompt_ids) + len(self.token_ids) >= self.max_context:
            self.finish_reason = "length"  # the next round's root would not fit the context
        out.finish_reason = self.finish_reason
        now = time.perf_counter()
        if raw.is_prefill:
            self.stats.prefill_seconds = raw.phase_seconds.get("prefill", 0.0)
            self._decode_start = now
        else:
            self.stats.record_round(len(raw.tokens), raw.phase_seconds)
            self.stats.decode_seconds = now - (self._decode_start or now)
        if self.finish_reason is not None:
            self.close()
        return out

    def _cut(self, tokens: list[int]) -> tuple[list[int], int | None]:
        """The round's tokens up to the first stop id (excluded) or the token limit; sets the finish reason."""
        kept: list[int] = []
        for token in tokens:
            if token in self._stop_ids:
                self.finish_reason = "stop"
                return kept, token
            kept.append(token)
            if len(self.token_ids) + len(kept) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        return kept, None

    def _logprobs(self, rows: tuple[torch.Tensor, torch.Tensor] | None, tokens: list[int]) -> list[TokenLogprob]:
        """Target log-probs of each emitted token at its own node (after the request's processors), and the
        request's number of best alternatives (`rows` may hold more: the fast path keeps 20)."""
        if not tokens:
            return []
        values, ids = (t[:len(tokens)].tolist() for t in rows)
        k = self.params.logprobs or 0
        return [TokenLogprob(token, row[0], list(zip(top[:k], row[1:1 + k], strict=True)))
                for token, row, top in zip(tokens, values, ids, strict=True)]

    def _prompt_logprobs(self, logits: torch.Tensor, k: int, chunk: int = 512) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability under the target given the tokens before it (the raw model's,
        as vLLM reports them), its rank and the top-k alternatives; None for the first token."""
        out: list[TokenLogprob | None] = [None]
        ids = torch.tensor(self.prompt_ids[1:], device=logits.device)
        for lo in range(0, len(ids), chunk):  # [chunk, V] float32 at a time, not the whole prompt's
            logp = torch.log_softmax(logits[lo:lo + chunk][:len(ids) - lo].float(), dim=-1)
            tokens = ids[lo:lo + chunk]
            chosen = logp.gather(1, tokens[:, None])[:, 0]
            ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
            top_lp, top_ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
            out += [TokenLogprob(t, lp, list(zip(i, v, strict=True)), r) for t, lp, r, i, v in zip(
                tokens.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist(), strict=True)]
        return out
