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


