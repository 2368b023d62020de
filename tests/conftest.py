"""Suite-wide settings and the fixtures several test packages share."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton's interpreter runs the fast path's kernels on the CPU (tests/kernels/,
# tests/fast/test_interpreted.py); it must be on before any kernel is defined, i.e. before anything imports
# ddtree.kernels: this file imports ddtree only inside its fixtures.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The models under test are tiny: one intra-op thread is faster than two fighting for CI's two cores.
torch.set_num_threads(1)


# Tiny random checkpoints in the real formats, built once per test session (by the tests that use them).


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    from tiny import make_draft, make_target

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
    from ddtree.engine import Engine

    return {arch: Engine.from_pretrained(ckpt / arch, ckpt / "draft", device="cpu")
            for arch in ("qwen3", "llama", "moe", "swa")}


@pytest.fixture(scope="session")
def fast_ckpt(tmp_path_factory) -> Path:
    from tiny import make_dflash2_draft, make_draft, make_target

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
def pairs(fast_ckpt) -> dict:
    """arch -> (reference engine, fast engine) over the same weights."""
    from ddtree.engine import Engine

    out = {}
    for arch in ("qwen3", "llama"):
        fast = Engine.from_pretrained(fast_ckpt / arch, fast_ckpt / "draft", device="cpu", fast=True,
                                      fast_capacity=256)
        out[arch] = (Engine(fast.target, fast.draft, fast.tokenizer), fast)
    return out


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The fast path's Triton kernels in Triton's interpreter, where a GPU would run them (CPU-only machines)."""
    from ddtree.kernels import jit

    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton's interpreter (CPU-only machines with Triton)")
    monkeypatch.setattr(jit, "INTERPRETED_ON_CPU", True)
