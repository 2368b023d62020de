"""A tiny target + drafter trained on CPU by the real trainers, once per test session."""

from pathlib import Path

import pytest
from ddtree.training.drafter import train_draft
from ddtree.training.target import TargetArch, train_target

TINY_ARCH = TargetArch(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, max_positions=256)


def write_corpus(root: Path) -> Path:
    """Small, regular Python-like files: learnable in a few dozen CPU steps."""
    root.mkdir(parents=True, exist_ok=True)
    for f in range(40):
        lines = []
        for i in range(12):
            n = f * 12 + i
            lines.append(f"def add_{n}(x, y):\n    total = x + y * {n % 7}\n    return total\n\n")
        (root / f"mod_{f}.py").write_text("".join(lines))
    return root


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train")
    corpus = [str(write_corpus(root / "corpus"))]
    quiet = lambda *_: None  # noqa: E731
    target = train_target(corpus, root / "target", arch=TINY_ARCH, vocab_size=320, globs=["*.py"], seq_len=64,
                          batch_size=8, lr=3e-3, steps=60, device="cpu", eval_every=1000, log=quiet)
    draft = train_draft(root / "target", corpus, root / "draft", layers=2, block_size=6, globs=["*.py"], seq_len=64,
                        blocks=6, batch_size=8, lr=3e-3, steps=30, device="cpu", eval_every=1000, save_every=1000,
                        log=quiet)
    dflash2 = train_draft(root / "target", corpus, root / "draft2", layers=2, block_size=6, globs=["*.py"], seq_len=64,
                          blocks=6, batch_size=8, lr=3e-3, steps=30, device="cpu", eval_every=1000, save_every=1000,
                          arch="dflash2", causal=True, log=quiet)
    return {"root": root, "corpus": corpus, "target": target, "draft": draft, "draft2": dflash2}
