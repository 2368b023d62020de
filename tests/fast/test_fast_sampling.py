"""The fast path samples the target's own distribution (temperature sampling), checked statistically.

Same method as tests/engine/test_sampling.py: on a 12-token vocabulary the exact distribution of the
first three tokens is computable, and 1000 seeded draws per method must fit it (chi-square, p > 1e-4).
"""

import pytest
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from distributions import exact_joint, fit_p_value
from tiny import make_dflash2_draft, make_draft, make_target

VOCAB, STEPS, DRAWS = 12, 3, 1000
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def small_vocab_fast(tmp_path_factory) -> Engine:
    root = tmp_path_factory.mktemp("small_vocab_fast")
    make_target(root / "t", vocab=VOCAB, seed=11)
    make_draft(root / "d", vocab=VOCAB, seed=12, block_size=4)
    return Engine.from_pretrained(root / "t", root / "d", device="cpu", fast=True, fast_capacity=256)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7),
                                dict(temperature=1.2, top_p=0.8), dict(temperature=1.0, top_k=4),
                                dict(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.7)])
def test_fast_path_sampling_follows_the_target_distribution(small_vocab_fast, kw):
    engine = small_vocab_fast
    joint = exact_joint(engine.target.model, PROMPT, VOCAB, STEPS, **kw)
    for method, budget in [("ddtree", 6), ("ar", None)]:
        counts: dict[tuple[int, ...], int] = {}
        for seed in range(DRAWS):
            params = SamplingParams(max_new_tokens=STEPS, seed=seed, ignore_eos=True, **kw)
            gen = engine.stream(PROMPT, params, method=method, budget=budget)
            assert gen.backend.name == "fast"
            list(gen)
            counts[tuple(gen.token_ids)] = counts.get(tuple(gen.token_ids), 0) + 1
        p_value = fit_p_value(counts, joint)
        assert p_value > 1e-4, f"{method} with {kw}: chi-square p = {p_value:.2e}"


@pytest.mark.slow
def test_sampling_with_a_draft_vocabulary_follows_the_target_distribution(small_vocab_fast):
    """Tokens the drafter cannot propose are still drawn as often as the target draws them (as bonus tokens)."""
    engine = small_vocab_fast
    sub = Engine(engine.target, engine.draft, fast=True, fast_capacity=256, draft_vocab=[0, 2, 4, 5, 7, 9])
    kw = dict(temperature=1.0)
    joint = exact_joint(engine.target.model, PROMPT, VOCAB, STEPS, **kw)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(DRAWS):
        gen = sub.stream(PROMPT, SamplingParams(max_new_tokens=STEPS, seed=seed, ignore_eos=True, **kw),
                         method="ddtree", budget=6)
        assert gen.backend.name == "fast"
        accepted += sum(r.accepted for r in gen)
        counts[tuple(gen.token_ids)] = counts.get(tuple(gen.token_ids), 0) + 1
    assert accepted > 0  # the drafter's tokens are still accepted
    assert fit_p_value(counts, joint) > 1e-4


@pytest.mark.slow
def test_sampling_over_a_dflash2_drafters_tree_follows_the_target_distribution(tmp_path):
    """The tree over DFlash2's selector, built on the device: the target's own distribution."""
    make_target(tmp_path / "t", vocab=VOCAB, seed=11)
    make_dflash2_draft(tmp_path / "d", vocab=VOCAB, seed=12, block_size=4)
    engine = Engine.from_pretrained(tmp_path / "t", tmp_path / "d", device="cpu", fast=True, fast_capacity=256)
    kw = dict(temperature=0.8)
    joint = exact_joint(engine.target.model, PROMPT, VOCAB, STEPS, **kw)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(DRAWS):
        gen = engine.stream(PROMPT, SamplingParams(max_new_tokens=STEPS, seed=seed, ignore_eos=True, **kw),
                            method="ddtree", budget=6)
        assert gen.backend.name == "fast"
        accepted += sum(r.accepted for r in gen)
        counts[tuple(gen.token_ids)] = counts.get(tuple(gen.token_ids), 0) + 1
    assert accepted > 0
    assert fit_p_value(counts, joint) > 1e-4


def test_fast_sampling_is_seeded_and_still_speculates(small_vocab_fast):
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=5, ignore_eos=True)
    first = small_vocab_fast.stream(PROMPT, params, method="ddtree", budget=6)
    assert first.backend.name == "fast"
    list(first)
    again = small_vocab_fast.generate(PROMPT, params, method="ddtree", budget=6)
    other = small_vocab_fast.generate(PROMPT, SamplingParams(max_new_tokens=200, temperature=1.0, seed=6,
                                                             ignore_eos=True), method="ddtree", budget=6)
    assert first.token_ids == again.token_ids != other.token_ids
    assert first.stats.acceptance_length > 1.05  # drafts are accepted under sampling (bonus tokens alone: 1.0)
