"""Tiny random checkpoints in the real formats, built once per test session."""

from pathlib import Path

import pytest
from ddtree.engine import Engine
from tiny import make_draft, make_target


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    make_target(root / "qwen3", "qwen3")
    make_target(root / "llama", "llama", seed=3)
    make_target(root / "moe", "qwen3_moe", seed=4)
    make_target(root / "swa", "qwen3", seed=5, sliding_window=6)
    make_draft(root / "draft")
    make_draft(root / "draft_new", layout="new", sliding_window=5, seed=2)
    return root


@pytest.fixture(scope="session")
def engines(ckpt):
    """One engine per target architecture, all with the same tiny draft."""
    return {arch: Engine.from_pretrained(ckpt / arch, ckpt / "draft", device="cpu")
            for arch in ("qwen3", "llama", "moe", "swa")}
