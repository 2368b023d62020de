"""A scripted stand-in for the engine: exact control over rounds, failures and timing in unit tests."""

from __future__ import annotations

import threading

from ddtree.engine import RoundOutput

WORDS = ["a", " b", " c", " STOP", " d", " e"]


class ScriptedGeneration:
    """Emits the scripted rounds (one per `gate` permit when gated); an exception in the script is raised."""

    def __init__(self, rounds: list, gate: threading.Semaphore | None) -> None:
        self.rounds = iter(rounds)
        self.gate = gate
        self.closed = False
        self.finish_reason = None

    def __iter__(self):
        return self

    def __next__(self) -> RoundOutput:
        if self.gate is not None:
            assert self.gate.acquire(timeout=10)
        item = next(self.rounds)
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self.closed = True


class ScriptedEngine:
    """What the server uses of an Engine; `scripts` holds one list of rounds per coming request."""

    method, budget, block_size, max_context, eos_token_ids = "ddtree", 4, 4, 64, {99}
    model_name = "scripted"
    tokenizer = None  # token-id prompts only
    vocab_size = len(WORDS)

    def __init__(self) -> None:
        self.scripts: list[list] = []
        self.generations: list[ScriptedGeneration] = []
        self.gate: threading.Semaphore | None = None
        self.params: list = []  # the SamplingParams of each request, in order
        self.generation_defaults: dict[str, float] = {}  # what a checkpoint's generation_config.json would set

    def decode(self, ids: list[int]) -> str:
        return "".join(WORDS[i] for i in ids)

    def batch(self, options) -> ScriptedBatch:
        return ScriptedBatch(self, options.max_num_seqs)

    def stream(self, prompt_ids, params, method=None, budget=None) -> ScriptedGeneration:
        self.params.append(params)
        gen = ScriptedGeneration(self.scripts.pop(0), self.gate)
        self.generations.append(gen)
        return gen


def prefill(token: int) -> RoundOutput:
    return RoundOutput([token], None, 0, 0, {"prefill": 0.001}, is_prefill=True)


def round_(tokens: list[int], finish: str | None = None) -> RoundOutput:
    phases = {"draft": 0.001, "tree": 0.0001, "verify": 0.002, "commit": 0.0001}
    return RoundOutput(tokens, None, 3, len(tokens) - 1, phases, finish)




class ScriptedSequence:
    def __init__(self, generation: ScriptedGeneration) -> None:
        self.generation = generation
        self.done = False
        self.cached_prompt = 0


class ScriptedBatch:
    """The batch engine's interface over scripted generations: each step runs every live request's next round,
    in the order they were added; an exception in a script fails that request only."""

    backends, blocks = (), None

    def __init__(self, engine: ScriptedEngine, max_num_seqs: int) -> None:
        from ddtree.engine.batch import StepStats

        self.engine, self.max_num_seqs = engine, max_num_seqs
        self.live: list[ScriptedSequence] = []
        self.last = StepStats()
        self.waiting = 0

    @property
    def running(self) -> int:
        return len(self.live)

    @property
    def kv_usage(self) -> float:
        """One scripted block per live request, as if the pool held max_num_seqs blocks."""
        return len(self.live) / self.max_num_seqs

    def add(self, prompt_ids, params, cache_salt=None) -> ScriptedSequence:
        seq = ScriptedSequence(self.engine.stream(prompt_ids, params))
        self.live.append(seq)
        return seq

    def abort(self, seq: ScriptedSequence) -> None:
        if seq in self.live:
            self.live.remove(seq)
        seq.generation.close()

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> list:
        out = []
        for seq in list(self.live):
            try:
                result = next(seq.generation)
            except Exception as exc:
                result = exc
            if isinstance(result, Exception) or result.finish_reason is not None:
                self.abort(seq)
            out.append((seq, result))
        return out
