"""The decoding engine: an `Engine` holds the models and hands out `Generation`s, each one request's loop
(generation.py) over a backend that yields raw rounds: the reference path (reference.py) or the fast path
(ddtree.fast)."""

from ddtree.engine.engine import Engine
from ddtree.engine.generation import Generation, GenerationResult, RoundOutput, TokenLogprob

__all__ = ["Engine", "Generation", "GenerationResult", "RoundOutput", "TokenLogprob"]
