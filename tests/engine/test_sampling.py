"""Sampling is lossless: DDTree's output distribution equals the target's own, checked statistically.

On a 12-token vocabulary the exact distribution of the first three sampled tokens is computable from the
target. We draw many sequences with `ddtree` (and `ar` as a control), each with its own seed, and apply
a chi-square goodness-of-fit test. Seeds are fixed, so the test is deterministic; the threshold
(p > 1e-4) makes a false alarm on a correct sampler very unlikely, while a sampler that, for example,
used the draft's distribution or forgot top-p fails by orders of magnitude.
"""

import itertools

import numpy as np
import pytest
import torch
from ddtree.engine import Engine
from ddtree.sampling import SamplingParams, process_logits
from scipy.stats import chisquare
from tiny import make_draft, make_target

VOCAB = 12
STEPS = 3
DRAWS = 1000


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_vocab")
    make_target(root / "t", vocab=VOCAB, seed=11)
    make_draft(root / "d", vocab=VOCAB, seed=12, block_size=4)
    return Engine.from_pretrained(root / "t", root / "d", device="cpu")


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """The intended distribution, written independently of ddtree.sampling."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).numpy()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    mass = 0.0
    for rank, token in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[token] = True
        mass += probs[token]
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def exact_joint(engine: Engine, prompt: list[int], **kw) -> dict[tuple[int, ...], float]:
    model = engine.target.model
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=STEPS):
        joint[seq] = 1.0
    with torch.no_grad():
        for depth in range(STEPS):
            for prefix in itertools.product(range(VOCAB), repeat=depth):
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
                p = reference_probs(logits, **kw)
                for seq in joint:
                    if seq[:depth] == prefix:
                        joint[seq] *= p[seq[depth]]
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_p=1.0, top_k=0), dict(temperature=0.8, top_p=0.8, top_k=0),
                                dict(temperature=1.3, top_p=1.0, top_k=4)])
def test_ddtree_samples_the_target_distribution(small_vocab_engine, kw):
    engine = small_vocab_engine
    prompt = [1, 2, 3]
    joint = exact_joint(engine, prompt, **kw)
    cells = sorted(joint, key=joint.get, reverse=True)
    for method, budget in [("ddtree", 6), ("ar", None)]:
        counts = dict.fromkeys(cells, 0)
        for seed in range(DRAWS):
            params = SamplingParams(max_new_tokens=STEPS, seed=seed, ignore_eos=True, **kw)
            counts[tuple(engine.generate(prompt, params, method=method, budget=budget).token_ids)] += 1
        # Pool the rarest cells so every expected count is at least 5.
        observed, expected, pool_o, pool_e = [], [], 0, 0.0
        for cell in cells:
            e = joint[cell] * DRAWS
            if e >= 5:
                observed.append(counts[cell])
                expected.append(e)
            else:
                pool_o += counts[cell]
                pool_e += e
        observed.append(pool_o)
        expected.append(pool_e)
        assert sum(counts.values()) == DRAWS
        impossible = [c for c in cells if joint[c] == 0 and counts[c]]
        assert not impossible, f"{method} produced sequences outside the top-k/top-p support: {impossible[:3]}"
        p_value = chisquare(observed, expected).pvalue
        assert p_value > 1e-4, f"{method}: chi-square p = {p_value:.2e}"


def test_speculation_happens_while_sampling(small_vocab_engine):
    """The statistical test is only meaningful if drafts are actually accepted under sampling."""
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=0, ignore_eos=True)
    stats = small_vocab_engine.generate([1, 2, 3], params, method="ddtree", budget=6).stats
    assert stats.acceptance_length > 1.15


def test_same_seed_same_output_and_processed_logits_respect_filters(small_vocab_engine):
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=42, ignore_eos=True)
    a = small_vocab_engine.generate([4, 5], params).token_ids
    assert a == small_vocab_engine.generate([4, 5], params).token_ids
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    kept = process_logits(logits, SamplingParams(temperature=1.0, top_k=2)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5)).isfinite()
    assert kept.tolist() == [[True, False, False, False]]
