"""Sampling is lossless: DDTree's output distribution equals the target's own, checked statistically.

On a 12-token vocabulary the exact distribution of the first three sampled tokens is computable from the
target. We draw many sequences with `ddtree` (and `ar` as a control, at the setting with the most steps:
penalties; each arm costs about 20 s on a 2-core machine), each with its own seed, and apply a chi-square
goodness-of-fit test. Seeds are fixed, so the test is deterministic; the threshold
(p > 1e-4) makes a false alarm on a correct sampler very unlikely, while a sampler that, for example,
used the draft's distribution or forgot top-p fails by orders of magnitude.
"""

import math

import pytest
import torch
from ddtree.core.sampling import SamplingParams, filter_logits, process_logits
from ddtree.engine import Engine
from distributions import event_p_value, exact_joint, fit_p_value
from tiny import make_dflash2_draft, make_draft, make_target

VOCAB = 12
STEPS = 3
DRAWS = 1000


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_vocab")
    make_target(root / "t", vocab=VOCAB, seed=11)
    make_draft(root / "d", vocab=VOCAB, seed=12, block_size=4)
    return Engine.from_pretrained(root / "t", root / "d", device="cpu")


DDTREE, AND_AR = [("ddtree", 6)], [("ddtree", 6), ("ar", None)]


@pytest.mark.slow
@pytest.mark.parametrize(("kw", "methods"), [
    (dict(temperature=1.0, top_p=1.0, top_k=0), DDTREE), (dict(temperature=0.8, top_p=0.8, top_k=0), DDTREE),
    (dict(temperature=1.3, top_p=1.0, top_k=4), DDTREE),
    (dict(temperature=1.0, repetition_penalty=3.0, frequency_penalty=2.0, presence_penalty=2.0), AND_AR)])
def test_ddtree_samples_the_target_distribution(small_vocab_engine, kw, methods):
    engine = small_vocab_engine
    prompt = [1, 2, 3]
    joint = exact_joint(engine.target.model, prompt, VOCAB, STEPS, **kw)
    for method, budget in methods:
        counts: dict[tuple[int, ...], int] = {}
        for seed in range(DRAWS):
            params = SamplingParams(max_new_tokens=STEPS, seed=seed, ignore_eos=True, **kw)
            seq = tuple(engine.generate(prompt, params, method=method, budget=budget).token_ids)
            counts[seq] = counts.get(seq, 0) + 1
        assert sum(counts.values()) == DRAWS
        p_value = fit_p_value(counts, joint)
        assert p_value > 1e-4, f"{method}: chi-square p = {p_value:.2e}"
        # Immediate repeats: the statistic penalties move most (a tree node must count its own path).
        p_value = event_p_value(counts, joint, lambda seq: seq[1] == seq[2])
        assert p_value > 1e-4, f"{method}: repeat-rate p = {p_value:.2e}"


@pytest.mark.slow
def test_a_dflash2_drafter_samples_the_target_distribution(tmp_path):
    """DFlash2's selector chain (`dflash`) and the tree over its transitions (`ddtree`) draft differently from
    DFlash, and the target still picks every token: the same exact distribution, and drafts get accepted."""
    make_target(tmp_path / "t", vocab=VOCAB, seed=11)
    make_dflash2_draft(tmp_path / "d", vocab=VOCAB, seed=12, block_size=4)
    engine = Engine.from_pretrained(tmp_path / "t", tmp_path / "d", device="cpu")
    assert engine.draft.candidate_selector is not None
    kw = dict(temperature=0.8, top_p=0.9)
    joint = exact_joint(engine.target.model, [1, 2, 3], VOCAB, STEPS, **kw)
    for method in ("ddtree", "dflash"):
        counts: dict[tuple[int, ...], int] = {}
        accepted = 0
        for seed in range(DRAWS):
            params = SamplingParams(max_new_tokens=STEPS, seed=seed, ignore_eos=True, **kw)
            result = engine.generate([1, 2, 3], params, method=method, budget=6)
            accepted += sum(result.stats.accepted_per_depth)
            counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        assert accepted > 0, method
        p_value = fit_p_value(counts, joint)
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


def test_penalties_bias_and_min_p_follow_their_formulas():
    from ddtree.core.sampling import History

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    history = History([4], vocab=5, device=torch.device("cpu"))  # token 4 is in the prompt
    history.add([0, 0, 2])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                            logit_bias=((1, 1.0),))
    got = process_logits(logits, params, history.rows([[3]]))  # this row's own pending token: 3
    # bias, then repetition (seen: 0, 2, 3, 4), then frequency (0: 2x, 2: 1x, 3: 1x) and presence
    want = torch.tensor([[2.0 / 2 - 0.5 * 2 - 0.25, 0.0, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2 - 0.5 - 0.25, -2.0 * 2]])
    assert torch.allclose(got, want)
    kept = process_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])),
                          SamplingParams(temperature=1.0, min_p=0.25)).isfinite()
    assert kept.tolist() == [[True, True, True, False]]  # 0.05 < 0.25 * 0.5


def _kept_by_definition(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Top-k then top-p, written out token by token: the reference the vectorised filter must match."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if top_k > 0:
        order = order[:top_k]
    weights = [math.exp(row[i] - row[order[0]]) for i in order]
    total, kept, mass = sum(weights), set(), 0.0
    for i, w in zip(order, weights, strict=True):
        if kept and mass >= top_p:
            break
        kept.add(i)
        mass += w / total
    return kept


@pytest.mark.parametrize("top_k", [0, 1, 5, 50])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99, 1.0])
def test_top_k_and_top_p_keep_exactly_the_tokens_their_definition_keeps(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 100 + int(100 * top_p))
    logits = torch.randn(8, 300, generator=gen, dtype=torch.float64) * 3  # distinct values: no ties
    kept = filter_logits(logits, top_k, top_p, 0.0).isfinite()
    for row, mask in zip(logits.tolist(), kept, strict=True):
        assert set(mask.nonzero().flatten().tolist()) == _kept_by_definition(row, top_k, top_p)


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, -3.0]])
    for top_k in (0, 2, 4):  # after top-k 2 the tie at the kth value already keeps all three 1.0s
        kept = filter_logits(logits, top_k, 0.5, 0.0).isfinite()
        assert kept.tolist() == [[True, True, True, True, False]]


@pytest.mark.parametrize("cap", [4, 64])
def test_a_floor_per_row_keeps_what_filter_logits_keeps_with_each_rows_own_settings(cap):
    """The batch's device round keeps `logits >= filter_floor(...)` for rows with their own temperature,
    min-p, top-k (<= cap) and top-p (with a top-k): exactly the tokens filter_logits keeps for each row alone.
    Logits rounded to steps of 0.25 tie often, also past the ranked `cap` (whose mass top-p must still count)."""
    from ddtree.core.sampling import filter_floor

    gen = torch.Generator().manual_seed(cap)
    settings = [(t, k, p, m) for t in (0.5, 1.0, 1.7) for k in (0, 1, 3, cap) for p in (1.0, 0.3, 0.9)
                for m in (0.0, 0.05) if k > 0 or p == 1.0] + [(1.0, 2, 0.3, 0.0)]
    logits = (torch.randn(len(settings), 200, generator=gen) * 2).mul(4).round().div(4).to(torch.bfloat16)
    logits[::2, :12] = logits[::2].max(dim=1, keepdim=True).values  # ties at the top, wider than the small cap
    logits[-1] = -5.0
    logits[-1, 0], logits[-1, 1:11] = 5.0, 4.0  # the first token alone holds 0.21 of the mass with its 10 ties
    temperature, top_k, top_p, min_p = (torch.tensor([s[i] for s in settings]) for i in range(4))
    floor = filter_floor(logits, temperature, top_k, top_p.float(), min_p.float(), cap)
    kept = logits >= floor[:, None]
    for row, (t, k, p, m) in enumerate(settings):
        want = filter_logits(logits[row:row + 1].float() / t, k, p, m).isfinite()[0]
        assert torch.equal(kept[row], want), (t, k, p, m)
