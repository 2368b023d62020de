"""The fast path emits exactly the reference path's greedy tokens, round for round."""

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine

PROMPTS = [[1, 2, 3, 4, 5], [17], [40, 41, 42, 43, 44, 45, 46, 47], list(range(60, 90))]
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)
RUNS = [("ar", None), ("dflash", None), ("ddtree", 1), ("ddtree", 5), ("ddtree", 15), ("ddtree", 64), ("ddtree", 128)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_same_tokens_and_same_acceptance_as_the_reference(pairs, arch):
    reference, fast = pairs[arch]
    for prompt in PROMPTS:
        ar = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in RUNS:
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            assert gen.backend.name == "fast"
            rounds = list(gen)
            ref = reference.stream(prompt, GREEDY, method=method, budget=budget)
            ref_rounds = list(ref)
            assert gen.token_ids == ref.token_ids == ar, (method, budget)
            # Same trees and same verify picks: every round accepts the same number of tokens.
            assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds]
            assert [r.draft_nodes for r in rounds] == [r.draft_nodes for r in ref_rounds]
            assert gen.stats.accepted_per_depth == ref.stats.accepted_per_depth
            assert set(gen.stats.phase_seconds) >= {"draft", "tree", "verify", "commit", "host"} - (
                {"draft"} if method == "ar" else set())


def test_a_sliding_window_draft_gives_the_reference_tokens(fast_ckpt):
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft_swa", device="cpu", fast=True,
                                  fast_capacity=256)
    assert None in fast.draft.config.layer_windows and 6 in fast.draft.config.layer_windows
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    for method, budget in (("dflash", None), ("ddtree", 16)):
        rounds_agree(fast, reference, list(range(60, 90)), GREEDY, method, budget)


def test_a_draft_vocabulary_gives_the_reference_trees_and_the_targets_tokens(pairs):
    reference, fast = pairs["qwen3"]
    hot = list(range(1, 96, 3))  # draft-logit column c is token 3c + 1: the trees must map them back
    sub_fast = Engine(fast.target, fast.draft, fast.tokenizer, fast=True, fast_capacity=256, draft_vocab=hot)
    sub_reference = Engine(fast.target, fast.draft, fast.tokenizer, draft_vocab=hot)
    assert sub_fast.fast.nodes("ddtree", 64) == 65 and sub_fast.fast.draft_head.size == 32
    for prompt in PROMPTS[:3:2]:
        ar = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            assert rounds_agree(sub_fast, sub_reference, prompt, GREEDY, method, budget) == ar


def test_stop_ids_eos_and_length_cut_like_the_reference(pairs, monkeypatch):
    reference, fast = pairs["qwen3"]
    full = reference.generate([1, 2, 3], GREEDY, method="ar").token_ids
    stop = full[9]
    for params in (SamplingParams(max_new_tokens=24, stop_token_ids=[stop], ignore_eos=True),
                   SamplingParams(max_new_tokens=7, ignore_eos=True),
                   SamplingParams(max_new_tokens=1, ignore_eos=True),  # the prefill's token ends it: no round
                   SamplingParams(max_new_tokens=24, stop_token_ids=[full[0]], ignore_eos=True)):
        for method in ("ar", "ddtree"):
            want = reference.generate([1, 2, 3], params, method=method)
            got = fast.generate([1, 2, 3], params, method=method)
            assert (got.token_ids, got.finish_reason, got.stop_token_id) == (
                want.token_ids, want.finish_reason, want.stop_token_id)
    assert got.finish_reason == "stop" and got.token_ids == []
    monkeypatch.setattr(fast, "eos_token_ids", {full[4]})
    got = fast.generate([1, 2, 3], SamplingParams(max_new_tokens=24), method="ddtree")
    assert (got.token_ids, got.finish_reason) == (full[:full.index(full[4])], "stop")


def rounds_agree(fast: Engine, reference: Engine, prompt: list[int], params: SamplingParams, method: str,
                 budget: int | None) -> list[int]:
    """Decode `prompt` on both engines: the fast path takes it, with the reference's tokens and acceptance
    round for round. Returns the tokens."""
    gen = fast.stream(prompt, params, method=method, budget=budget)
    rounds = list(gen)
    ref = reference.stream(prompt, params, method=method, budget=budget)
    ref_rounds = list(ref)
    assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids, (method, budget)
    assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds], (method, budget)
    return gen.token_ids


def prompt_logprobs_agree(got: list, want: list, tolerance: float = 1e-5) -> None:
    """Prompt logprob entries (the first None) equal up to float32 rounding: token, rank, alternatives."""
    assert got[0] is None and want[0] is None and len(got) == len(want)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert (g.token_id, g.rank) == (w.token_id, w.rank) and abs(g.logprob - w.logprob) < tolerance
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert all(abs(a - b) < tolerance for (_, a), (_, b) in zip(g.top, w.top, strict=True))


@pytest.mark.parametrize(("method", "budget"), [("ar", None), ("ddtree", 8)])
def test_prompt_logprobs_on_the_fast_path_equal_the_reference_paths(pairs, method, budget):
    """A request for prompt logprobs (completions' echo with logprobs) prefills and decodes on the fast path."""
    reference, fast = pairs["qwen3"]
    params = SamplingParams(max_new_tokens=12, prompt_logprobs=3, logprobs=2, ignore_eos=True)
    prompt = list(range(40, 70))
    gen = fast.stream(prompt, params, method=method, budget=budget)
    first = next(gen)
    list(gen)
    ref = reference.stream(prompt, params, method=method, budget=budget)
    ref_first = next(ref)
    list(ref)
    assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids
    prompt_logprobs_agree(first.prompt_logprobs, ref_first.prompt_logprobs)
    assert len(first.prompt_logprobs) == len(prompt)


def test_warm_up_builds_the_plans_requests_will_run_and_leaves_no_trace(fast_ckpt):
    """A server warms its engine up before it says it is ready: one plan per sampling setting, at the
    engine's method and budget; the requests after it decode as if it never ran."""
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu", fast=True,
                                  fast_capacity=256, method="ddtree", budget=12)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    sampled = SamplingParams(temperature=0.7, top_k=5)
    assert fast.warm_up(sampled, SamplingParams()) == ["temperature 0.7", "greedy"]
    assert set(fast.fast._plans) == {("ddtree", 12, True, (5, 1.0, 0.0), False, False, False),
                                     ("ddtree", 12, False, None, False, False, False)}
    got = fast.generate([5, 6, 7], GREEDY)
    assert got.token_ids == reference.generate([5, 6, 7], GREEDY).token_ids and got.stats.rounds > 1
    assert Engine(fast.target, fast.draft, fast.tokenizer).warm_up(SamplingParams()) == []  # no fast path


def test_requests_the_fast_path_cannot_serve_take_the_reference_path(pairs, fast_ckpt):
    reference, fast = pairs["qwen3"]
    wide = SamplingParams(max_new_tokens=4, logprobs=25, ignore_eos=True)  # a round keeps 20 alternatives
    gen = fast.stream([1, 2, 3], wide)
    got = [entry for r in gen for entry in r.logprobs]
    assert gen.backend.name == "reference" and all(len(entry.top) == 25 for entry in got)
    assert got == [entry for r in reference.stream([1, 2, 3], wide) for entry in r.logprobs]
    too_long = SamplingParams(max_new_tokens=fast.fast.capacity, ignore_eos=True)
    assert fast.stream([1, 2, 3], too_long).backend.name == "reference"
    assert fast.stream([1, 2, 3], GREEDY, method="ddtree", budget=0).backend.name == "reference"
    swa = Engine.from_pretrained(fast_ckpt / "swa", fast_ckpt / "draft", device="cpu", fast=True)
    assert swa.fast is None and "sliding" in swa.fast_unsupported
    assert Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu").fast is None


def test_one_generation_at_a_time_on_the_static_caches(pairs):
    reference, fast = pairs["qwen3"]
    first = fast.stream([1, 2, 3], GREEDY)
    next(first)
    second = fast.stream([4, 5, 6], GREEDY)
    assert first.backend.name == "fast" and second.backend.name == "reference"
    list(first)
    list(second)
    assert second.token_ids == reference.generate([4, 5, 6], GREEDY).token_ids
    assert fast.stream([4, 5, 6], GREEDY).backend.name == "fast"  # released once the first one ended
    assert torch.equal(torch.tensor(first.token_ids), torch.tensor(reference.generate([1, 2, 3], GREEDY).token_ids))


def test_the_next_round_is_queued_early_and_a_wasted_one_harms_nothing(pairs, monkeypatch):
    """Rounds are queued one ahead of the host; only a stop token can leave one unread, and the next
    generation still matches the reference."""
    from ddtree.fast.plan import Plan

    reference, fast = pairs["qwen3"]
    monkeypatch.setattr(fast.fast, "queue_ahead", True)  # the CUDA default; the CPU runs a round when launched
    launches = []
    real_launch = Plan.launch
    monkeypatch.setattr(Plan, "launch", lambda self, *a, **kw: launches.append(1) or real_launch(self, *a, **kw))
    full = reference.generate([1, 2, 3], GREEDY, method="ddtree", budget=8).token_ids
    stopped = SamplingParams(max_new_tokens=32, stop_token_ids=[full[20]], ignore_eos=True)
    got = fast.generate([1, 2, 3], stopped, method="ddtree", budget=8)
    assert got.finish_reason == "stop" and got.token_ids == full[:full.index(full[20])]
    assert len(launches) == got.stats.rounds + 1  # the round queued behind the stopping one, never read
    launches.clear()
    after = fast.generate(list(range(60, 90)), GREEDY, method="ddtree", budget=8)
    assert after.token_ids == reference.generate(list(range(60, 90)), GREEDY, method="ddtree", budget=8).token_ids
    assert len(launches) == after.stats.rounds  # a length limit is seen coming: nothing is wasted


def test_budgets_above_the_tested_tree_size_take_the_reference_path(fast_ckpt):
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu", fast=True,
                                  fast_capacity=2048)  # room for any tree: only the budget decides
    big = fast.stream([1, 2, 3], GREEDY, method="ddtree", budget=300)
    assert big.backend.name == "reference"
    assert fast.stream([1, 2, 3], GREEDY, method="ddtree", budget=256).backend.name == "fast"
    list(big)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert big.token_ids == reference.generate([1, 2, 3], GREEDY, method="ddtree", budget=300).token_ids


def test_a_default_budget_beyond_the_fast_path_is_said_at_startup(fast_ckpt, caplog, capsys):
    from ddtree.api.config import ServerConfig
    from ddtree.api.state import ServerState
    from ddtree.cli import main

    big = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu", fast=True, budget=300)
    assert "budget 300 is above the fast path's largest tree (256 nodes)" in big.fast_note
    fits = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu", fast=True, budget=256)
    assert fits.fast_note is None
    state = ServerState(ServerConfig())
    with caplog.at_level("WARNING", logger="ddtree.server"):
        state.load(lambda: big)
    state.scheduler.shutdown(timeout=5)
    assert any("take the reference path" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert main(["generate", "--target", str(fast_ckpt / "qwen3"), "--draft", str(fast_ckpt / "draft"),
                 "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--budget", "300", "--fast", "--device", "cpu"]) == 0
    assert "ddtree generate: budget 300 is above the fast path's largest tree" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [dict(repetition_penalty=1.4), dict(frequency_penalty=0.8, presence_penalty=0.6),
                                   dict(logit_bias=((5, 2.0), (7, -100.0))),
                                   dict(repetition_penalty=0.7, frequency_penalty=-0.5, logit_bias=((11, 1.5),))])
def test_penalties_and_logit_bias_give_the_reference_tokens_round_for_round(pairs, extra):
    """Each tree node is penalized for the emitted tokens plus its own path (on the device): the same tokens
    and the same acceptance as the reference path, whose History does it on the host."""
    reference, fast = pairs["qwen3"]
    prompt = [40, 41, 42, 43, 40, 41, 42, 43]  # repeats, so the repetition penalty has work from the start
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, **extra)
    assert fast.generate(prompt, params, method="ar").token_ids != fast.generate(prompt, GREEDY, method="ar").token_ids
    for method, budget in RUNS[:5]:
        rounds_agree(fast, reference, prompt, params, method, budget)


def test_sampled_penalized_requests_stay_on_the_fast_path_and_a_seed_fixes_them(pairs):
    _, fast = pairs["qwen3"]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, presence_penalty=0.5, seed=3,
                            ignore_eos=True)
    gen = fast.stream([1, 2, 3], params, method="ddtree", budget=8)
    assert gen.backend.name == "fast"
    list(gen)
    assert gen.token_ids == fast.generate([1, 2, 3], params, method="ddtree", budget=8).token_ids


def test_filtered_sampling_runs_on_the_fast_path_for_a_bounded_number_of_settings(pairs, monkeypatch):
    from ddtree.fast import runner as fast_module

    _, fast = pairs["qwen3"]
    monkeypatch.setattr(fast.fast, "_plans", {})
    monkeypatch.setattr(fast_module, "MAX_FILTER_SETTINGS", 2)
    settings = [dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1)]
    for i, kw in enumerate(settings):
        params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=i, ignore_eos=True, **kw)
        gen = fast.stream([1, 2, 3], params, method="ddtree", budget=8)
        # a third distinct setting would capture a third set of graphs
        assert (gen.backend.name == "fast") == (i < 2), kw
        list(gen)
    again = SamplingParams(max_new_tokens=6, temperature=0.5, top_p=0.9, ignore_eos=True)
    # a known setting, any temperature
    assert fast.stream([4, 5], again, method="ddtree", budget=8).backend.name == "fast"


@pytest.mark.parametrize("extra", [dict(logprobs=3), dict(logprobs=0, presence_penalty=0.5, logit_bias=((5, 1.0),))])
def test_logprobs_on_the_fast_path_equal_the_reference_paths(pairs, extra, monkeypatch):
    """Logprob rounds are queued ahead too (their rows come back with the round's result), and every entry,
    alternatives included, equals the reference path's."""
    reference, fast = pairs["qwen3"]
    monkeypatch.setattr(fast.fast, "queue_ahead", True)  # the CUDA default
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **extra)
    for method, budget in RUNS[:4]:
        gen = fast.stream([1, 2, 3, 4], params, method=method, budget=budget)
        got = [entry for r in gen for entry in r.logprobs]
        want = [entry for r in reference.stream([1, 2, 3, 4], params, method=method, budget=budget)
                for entry in r.logprobs]
        assert gen.backend.name == "fast" and len(got) == len(want) == 24
        for g, w in zip(got, want, strict=True):
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-5
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(g.top, w.top, strict=True))


def test_sampled_logprobs_are_the_processed_distributions_of_the_drawn_tokens(pairs):
    """Sampled draws differ between the paths, so each reported log-probability is checked against the
    target run directly over the prompt and the drawn tokens, through the reference's own processing."""
    from ddtree.core.sampling import process_logits

    _, fast = pairs["qwen3"]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=6, seed=4, logprobs=2, ignore_eos=True)
    gen = fast.stream([1, 2, 3, 4], params, method="ddtree", budget=8)
    entries = [entry for r in gen for entry in r.logprobs]
    assert gen.backend.name == "fast" and [e.token_id for e in entries] == gen.token_ids
    ids = [1, 2, 3, 4, *gen.token_ids]
    with torch.no_grad():
        logits = fast.target.model(torch.tensor([ids])).logits[0, 3:-1]
    logp = torch.log_softmax(process_logits(logits, params), dim=-1)
    for row, entry in zip(logp, entries, strict=True):
        assert abs(row[entry.token_id].item() - entry.logprob) < 1e-4
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()
