"""Tiny random Qwen3 and Llama pairs, each loaded twice: on the reference path and on the fast path."""

from pathlib import Path

import pytest
from ddtree.engine import Engine
from tiny import make_dflash2_draft, make_draft, make_target


@pytest.fixture(scope="session")
def fast_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fast_ckpt")
    make_target(root / "qwen3", "qwen3")
    make_target(root / "llama", "llama", seed=3)
    make_target(root / "swa", "qwen3", seed=5, sliding_window=6)
    make_draft(root / "draft")
    make_draft(root / "draft_swa", seed=7, sliding_window=6)  # sliding-window draft layers, as Qwen3.6's drafts have
    make_dflash2_draft(root / "draft_dflash2", seed=8)  # DFlash2: convolutions and a candidate selector
    make_draft(root / "draft_sinks", seed=9, sliding_window=3, sinks="sinks", is_causal=True,  # every 2026 field
               fields={"input_embedding_scale": 2.0, "output_multiplier": 1.5, "final_logit_softcapping": 4.0})
    return root


@pytest.fixture(scope="session")
def pairs(fast_ckpt) -> dict[str, tuple[Engine, Engine]]:
    """arch -> (reference engine, fast engine) over the same weights."""
    out = {}
    for arch in ("qwen3", "llama"):
        fast = Engine.from_pretrained(fast_ckpt / arch, fast_ckpt / "draft", device="cpu", fast=True,
                                      fast_capacity=256)
        out[arch] = (Engine(fast.target, fast.draft, fast.tokenizer), fast)
    return out
