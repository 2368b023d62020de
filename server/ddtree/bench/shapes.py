"""The benchmarks' engine pairs (fast and eager) over a random-weight shape (models/shapes.py), seeded so runs of one
shape compare the same weights, or over a loaded pair."""


from __future__ import annotations

import torch

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.models.draft_vocab import load_draft_vocab
from ddtree.models.shapes import build_models


def build_shape(name: str, device: torch.device, dtype: torch.dtype, fast_capacity: int,
                draft_vocab: str | None = None, draft_quantization: str | None = None,
                quantization: str | None = None) -> tuple[Engine, Engine]:
    """(fast engine, eager engine) over one random-weight model of a published shape, built on the device
    (models/shapes.py `build_models`: seeded)."""
    target, draft = build_models(name, device, dtype, quantization)
    hot = draft_vocab_ids(draft_vocab, target.shape.vocab_size)
    fast = Engine(target, draft, fast=True, fast_capacity=fast_capacity, model_name=name, draft_vocab=hot,
                  draft_quantization=draft_quantization)
    return fast, Engine(target, draft, model_name=name, draft_vocab=fast.draft_head,
                        draft_quantization=draft_quantization)


def build_pair(target: str | None, draft: str | None, device: str, dtype: str | None, fast_capacity: int,
               draft_vocab: str | None = None, draft_quantization: str | None = None,
               quantization: str | None = None) -> tuple[Engine, Engine]:
    """(fast engine, eager engine) over one loaded pair: the fast path's static caches are built once, after
    the draft vocabulary (a file, or N lowest ids) is known. Both share one (quantized) draft and head."""
    loaded = Engine.from_pretrained(target, draft, device=device, dtype=dtype, quantization=quantization)
    hot = draft_vocab_ids(draft_vocab, loaded.vocab_size)
    pair = (loaded.target, loaded.draft, loaded.tokenizer)
    fast = Engine(*pair, model_name=loaded.model_name, fast=True, fast_capacity=fast_capacity, draft_vocab=hot,
                  draft_quantization=draft_quantization)
    return fast, Engine(*pair, model_name=loaded.model_name, draft_vocab=fast.draft_head,
                        draft_quantization=draft_quantization)


def draft_vocab_ids(spec: str | None, vocab_size: int) -> list[int] | None:
    """--draft-vocab: a draft vocabulary file's ids, or for a number N the N lowest ids (what a random-weight
    shape's costs need: any N tokens cost the same)."""
    if spec is None:
        return None
    if spec.isdigit():
        if not 1 <= int(spec) <= vocab_size:
            raise DDTreeError(f"--draft-vocab must be in 1..{vocab_size} tokens, got {spec}")
        return list(range(int(spec)))
    return load_draft_vocab(spec, vocab_size)


