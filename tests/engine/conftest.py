"""Fixtures the batch tests share."""

import pytest
from tiny import make_draft, make_target


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory):
    """A 12-token target and drafter on the CPU: few enough continuations that their exact joint distribution is
    computable, for the sampling tests."""
    from ddtree.engine import Engine

    root = tmp_path_factory.mktemp("small_vocab")
    make_target(root / "t", vocab=12, seed=11)
    make_draft(root / "d", vocab=12, seed=12, block_size=4)
    return Engine.from_pretrained(root / "t", root / "d", device="cpu")


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory):
    """For the tests that run the kernels in Triton's interpreter (every launch is slow there): a two-layer target
    and one-layer drafters over it (a plain one and a DFlash2 one), and a two-layer drafter with every 2026 field
    (a sliding-window layer with sinks, then a full-attention one)."""
    from tiny import make_dflash2_draft

    root = tmp_path_factory.mktemp("small_ckpt")
    make_target(root / "qwen3", "qwen3", layers=2)
    make_draft(root / "draft", target_layers=2, layers=1, taps=[0, 1])
    make_dflash2_draft(root / "draft_dflash2", seed=8, target_layers=2, layers=1, taps=[0, 1])
    make_draft(root / "draft_sinks", seed=9, target_layers=2, taps=[0, 1], sliding_window=3, sinks="sinks",
               is_causal=True, fields={"input_embedding_scale": 2.0, "output_multiplier": 1.5,
                                       "final_logit_softcapping": 4.0})
    return root


@pytest.fixture(scope="session")
def small_engine(small_ckpt):
    """small_ckpt's target under its plain one-layer drafter."""
    from ddtree.engine import Engine

    return Engine.from_pretrained(small_ckpt / "qwen3", small_ckpt / "draft", device="cpu")
