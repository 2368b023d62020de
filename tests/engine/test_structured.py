"""Structured outputs: a JSON schema constrains every method alike, per tree node, and stays lossless."""

from __future__ import annotations

import json

import pytest
import torch
from ddtree.engine import Engine
from ddtree.grammar import Constraint, choice_grammar, json_schema_grammar
from ddtree.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 12}},
          "required": ["ok", "name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo() -> Engine:
    return Engine.from_pretrained(device="cpu")  # a real tokenizer and a model that writes code, not JSON


def prompt(engine: Engine) -> list[int]:
    return engine.chat_ids([{"role": "user", "content": "Describe the file as JSON."}])


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"ok", "name"} and isinstance(value["ok"], bool) and isinstance(value["name"], str)


def test_greedy_constrained_output_is_valid_and_identical_across_methods(demo):
    params = SamplingParams(max_new_tokens=60, grammar=json_schema_grammar(SCHEMA))
    ar = demo.generate(prompt(demo), params, method="ar")
    assert ar.finish_reason == "stop" and matches_schema(demo.decode(ar.token_ids))
    for method, budget in (("dflash", None), ("ddtree", 4), ("ddtree", 32)):
        out = demo.generate(prompt(demo), params, method=method, budget=budget)
        assert out.token_ids == ar.token_ids, (method, budget)
    free = demo.generate(prompt(demo), SamplingParams(max_new_tokens=len(ar.token_ids)), method="ar")
    assert free.token_ids != ar.token_ids  # the constraint is what made it JSON


def test_sampled_constrained_outputs_are_always_valid(demo):
    for seed in range(6):
        params = SamplingParams(max_new_tokens=80, temperature=1.0, seed=seed, grammar=json_schema_grammar(SCHEMA))
        out = demo.generate(prompt(demo), params, method="ddtree", budget=16)
        assert out.finish_reason == "stop" and matches_schema(demo.decode(out.token_ids)), seed


def test_each_tree_node_is_masked_for_its_own_path(demo):
    """The masks of a batch of paths equal a fresh matcher's after feeding each path alone."""
    tok = demo.grammar_tokenizer
    grammar = json_schema_grammar(SCHEMA)
    emitted = demo.tokenizer.encode('{"ok": ')
    prefix = Constraint(tok, grammar, demo.vocab_size)
    prefix.consume(emitted)
    paths = [[], demo.tokenizer.encode("true"), demo.tokenizer.encode("tr"), demo.tokenizer.encode("false,"),
             demo.tokenizer.encode("nope")]
    got = prefix.allowed(paths)
    for path, row in zip(paths, got, strict=True):
        alone = Constraint(tok, grammar, demo.vocab_size)
        alone.consume(emitted)
        if alone.matcher.try_consume_tokens(path) == len(path):
            want = alone.allowed([[]])[0]
        else:  # an invalid path: never accepted, so it allows everything rather than nothing
            want = torch.ones(demo.vocab_size, dtype=torch.bool)
        assert torch.equal(row, want), demo.decode(path)
    assert 0 < got[0].sum() < demo.vocab_size  # the grammar does restrict the next token
    again = prefix.allowed([[]])  # asking about paths leaves the emitted state as it was
    assert torch.equal(again[0], got[0])


def test_the_output_ends_when_the_grammar_is_complete_even_under_ignore_eos(demo):
    params = SamplingParams(max_new_tokens=60, ignore_eos=True, grammar=json_schema_grammar(SCHEMA))
    out = demo.generate(prompt(demo), params, method="ddtree", budget=8)
    assert out.finish_reason == "stop" and len(out.token_ids) < 60
    assert matches_schema(demo.decode(out.token_ids))


def test_a_bad_schema_is_a_value_error():
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        json_schema_grammar({"type": "objectx"})


def test_the_fast_path_serves_constrained_requests_with_the_reference_tokens(demo):
    fast = Engine.from_pretrained(device="cpu", fast=True)
    params = SamplingParams(max_new_tokens=60, grammar=json_schema_grammar(SCHEMA))
    want = demo.generate(prompt(demo), params, method="ar").token_ids
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 8)):
        gen = fast.stream(prompt(fast), params, method=method, budget=budget)
        assert gen.on_fast_path
        list(gen)
        assert gen.token_ids == want, method
    sampled = SamplingParams(max_new_tokens=80, temperature=1.0, seed=2, grammar=json_schema_grammar(SCHEMA))
    gen = fast.stream(prompt(fast), sampled, method="ddtree", budget=16)
    list(gen)
    assert gen.on_fast_path and gen.finish_reason == "stop" and matches_schema(fast.decode(gen.token_ids))
    for options in (["a"], ['"a"']):  # one token, complete at the prefill; or three
        only = SamplingParams(max_new_tokens=10, grammar=choice_grammar(options))
        got = fast.generate(prompt(fast), only, method="ddtree", budget=8)
        assert fast.decode(got.token_ids) == options[0] and got.finish_reason == "stop"
    assert len(fast.generate(prompt(fast), SamplingParams(max_new_tokens=10, grammar=choice_grammar(["a"])),
                             method="ddtree").token_ids) == 1
