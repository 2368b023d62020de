"""Greedy speculative decoding is the target's own greedy decoding, token for token."""

from collections.abc import Callable

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.reference import ReferenceBackend
from tiny import EOS_ID, MASK_ID
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 2, 3, 4, 5], [17], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [9, 9, 9, 9]]
GREEDY = SamplingParams(max_new_tokens=48, ignore_eos=True)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "moe", "swa"])
def test_ar_equals_transformers_generate(engines, ckpt, arch):
    model = AutoModelForCausalLM.from_pretrained(ckpt / arch)
    model.generation_config.eos_token_id = None  # compare whole continuations (GREEDY ignores EOS)
    for prompt in PROMPTS:
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_new_tokens,
                                  do_sample=False)[0, len(prompt):].tolist()
        assert engines[arch].generate(prompt, GREEDY, method="ar").token_ids == expected


@pytest.fixture(scope="module")
def ar_reference(engines):
    cache: dict = {}

    def get(arch: str, prompt: list[int]) -> list[int]:
        key = (arch, tuple(prompt))
        if key not in cache:
            cache[key] = engines[arch].generate(prompt, GREEDY, method="ar").token_ids
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ["qwen3", "llama", "moe", "swa"])
@pytest.mark.parametrize("budget", [1, 4, 15, 64, 256])
def test_ddtree_and_dflash_equal_ar(engines, ar_reference, arch, budget):
    engine = engines[arch]
    for prompt in PROMPTS + random_prompts(2, seed=budget):
        ar = ar_reference(arch, prompt)
        assert engine.generate(prompt, GREEDY, method="ddtree", budget=budget).token_ids == ar
        if budget == 4:
            assert engine.generate(prompt, GREEDY, method="dflash").token_ids == ar


def test_new_layout_sliding_window_draft_is_lossless_too(ckpt):
    engine = Engine.from_pretrained(ckpt / "qwen3", ckpt / "draft_new", device="cpu")
    for prompt in random_prompts(4, seed=7):
        ar = engine.generate(prompt, GREEDY, method="ar").token_ids
        assert engine.generate(prompt, GREEDY, budget=32).token_ids == ar


def oracle_draft(model, context: Callable[[], list[int]]):
    """Draft logits that put all mass on the target's own greedy continuation of `context()`, the tokens so far."""

    def draft(self: ReferenceBackend, root: int, start: int, draft_cache) -> torch.Tensor:
        tokens = context()
        assert tokens[-1] == root and len(tokens) == start + 1
        cont = model.generate(torch.tensor([tokens]), max_new_tokens=self.block_size - 1, do_sample=False)
        return torch.nn.functional.one_hot(cont[0, len(tokens):], model.config.vocab_size).float() * 50

    return draft


@pytest.mark.parametrize("method,budget", [("ddtree", 7), ("ddtree", 32), ("dflash", None)])
def test_oracle_draft_accepts_a_whole_block_every_full_round(engines, ckpt, monkeypatch, method, budget):
    engine = engines["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(ckpt / "qwen3")
    model.generation_config.eos_token_id = None
    params = SamplingParams(max_new_tokens=1 + 4 * engine.block_size, ignore_eos=True)
    gen = engine.stream([5, 6, 7], params, method=method, budget=budget)
    monkeypatch.setattr(ReferenceBackend, "_draft", oracle_draft(model, lambda: [5, 6, 7, *gen.token_ids]))
    rounds = [out for out in gen if not out.is_prefill]
    assert [len(r.token_ids) for r in rounds] == [engine.block_size] * 4
    assert gen.stats.acceptance_length == engine.block_size
    assert gen.stats.accepted_per_depth == [4] * (engine.block_size - 1)
    assert gen.token_ids == engine.generate([5, 6, 7], params, method="ar").token_ids


def test_stops_at_eos_and_stop_ids_without_emitting_them(engines):
    engine = engines["qwen3"]
    full = engine.generate([1, 2, 3], GREEDY, method="ar").token_ids
    stop_at = full[10]
    cut = full.index(stop_at)
    for method in ("ar", "ddtree"):
        res = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=48, stop_token_ids=[stop_at], ignore_eos=True),
                              method=method)
        assert (res.token_ids, res.finish_reason, res.stop_token_id) == (full[:cut], "stop", stop_at)
        res = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=7, ignore_eos=True), method=method)
        assert (res.token_ids, res.finish_reason) == (full[:7], "length")


def test_eos_ends_generation_unless_ignored(engines, monkeypatch):
    engine = engines["qwen3"]
    full = engine.generate([1, 2, 3], GREEDY, method="ar").token_ids
    eos = full[5]
    monkeypatch.setattr(engine, "eos_token_ids", {EOS_ID, eos})
    res = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=48), method="ddtree")
    assert (res.token_ids, res.finish_reason, res.stop_token_id) == (full[:full.index(eos)], "stop", eos)
    assert engine.generate([1, 2, 3], GREEDY, method="ddtree").token_ids == full


def test_tokens_equal_to_the_mask_id_are_kept(engines):
    """The mask id is an ordinary vocabulary row for the target: if the target picks it, it is output."""
    engine = engines["qwen3"]

    def favour_mask(_module, inputs, logits):
        hidden = inputs[0]
        logits[..., MASK_ID] = logits.max(-1).values + (hidden[..., 0] > 0).float()  # sometimes the argmax
        return logits

    hook = engine.target.lm_head.register_forward_hook(favour_mask)
    try:
        ar = engine.generate([1, 2, 3], GREEDY, method="ar").token_ids
        assert MASK_ID in ar
        assert engine.generate([1, 2, 3], GREEDY, method="ddtree").token_ids == ar
    finally:
        hook.remove()


def test_repetition_penalty_ar_equals_transformers_generate(engines, ckpt):
    model = AutoModelForCausalLM.from_pretrained(ckpt / "qwen3")
    model.generation_config.eos_token_id = None
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, repetition_penalty=1.6)
    for prompt in PROMPTS:
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                  repetition_penalty=1.6)[0, len(prompt):].tolist()
        assert engines["qwen3"].generate(prompt, params, method="ar").token_ids == expected


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.6), dict(frequency_penalty=1.5),
                                       dict(presence_penalty=2.0, logit_bias=((7, 3.0),)),
                                       dict(frequency_penalty=-1.0, presence_penalty=0.5, repetition_penalty=0.8)])
def test_penalties_keep_ddtree_and_dflash_equal_to_ar(engines, penalties):
    """Each tree node is penalized for its own path below the root, as AR would be after those tokens."""
    engine = engines["qwen3"]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, **penalties)
    changed = False
    for prompt in PROMPTS + random_prompts(2, seed=3):
        ar = engine.generate(prompt, params, method="ar").token_ids
        changed |= ar != engine.generate(prompt, GREEDY, method="ar").token_ids[:40]
        for budget in (4, 32):
            assert engine.generate(prompt, params, method="ddtree", budget=budget).token_ids == ar, budget
        assert engine.generate(prompt, params, method="dflash").token_ids == ar
    assert changed  # the penalties do change the output: the comparison is not vacuous
