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
