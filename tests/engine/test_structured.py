"""Structured outputs: a JSON schema constrains every method alike, per tree node, and stays lossless; with a
think block, only after it closes."""

from __future__ import annotations

import json

import pytest
import torch
from ddtree.core.grammar import Constraint, choice_grammar, json_schema_grammar, unpack
from ddtree.core.sampling import SamplingParams, ThinkBlock
from ddtree.engine import Engine

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


def masks(constraint: Constraint, paths: list[list[int]]) -> torch.Tensor:
    """The constraint's masks for `paths`, unpacked: bool [N, vocab]."""
    return unpack(constraint.allowed(paths), constraint.vocab_size)


def test_each_tree_node_is_masked_for_its_own_path(demo):
    """The masks of a batch of paths equal a fresh matcher's after feeding each path alone."""
    tok = demo.grammar_tokenizer
    grammar = json_schema_grammar(SCHEMA)
    emitted = demo.tokenizer.encode('{"ok": ')
    prefix = Constraint(tok, grammar, demo.vocab_size)
    prefix.consume(emitted)
    paths = [[], demo.tokenizer.encode("true"), demo.tokenizer.encode("tr"), demo.tokenizer.encode("false,"),
             demo.tokenizer.encode("nope")]
    got = masks(prefix, paths)
    for path, row in zip(paths, got, strict=True):
        alone = Constraint(tok, grammar, demo.vocab_size)
        alone.consume(emitted)
        if alone.matcher.try_consume_tokens(path) == len(path):
            want = masks(alone, [[]])[0]
        else:  # an invalid path: never accepted, so it allows everything rather than nothing
            want = torch.ones(demo.vocab_size, dtype=torch.bool)
        assert torch.equal(row, want), demo.decode(path)
    assert 0 < got[0].sum() < demo.vocab_size  # the grammar does restrict the next token
    again = masks(prefix, [[]])  # asking about paths leaves the emitted state as it was
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
        assert gen.backend.name == "fast"
        list(gen)
        assert gen.token_ids == want, method
    sampled = SamplingParams(max_new_tokens=80, temperature=1.0, seed=2, grammar=json_schema_grammar(SCHEMA))
    gen = fast.stream(prompt(fast), sampled, method="ddtree", budget=16)
    list(gen)
    assert gen.backend.name == "fast" and gen.finish_reason == "stop" and matches_schema(fast.decode(gen.token_ids))
    for options in (["a"], ['"a"']):  # one token, complete at the prefill; or three
        only = SamplingParams(max_new_tokens=10, grammar=choice_grammar(options))
        got = fast.generate(prompt(fast), only, method="ddtree", budget=8)
        assert fast.decode(got.token_ids) == options[0] and got.finish_reason == "stop"
    assert len(fast.generate(prompt(fast), SamplingParams(max_new_tokens=10, grammar=choice_grammar(["a"])),
                             method="ddtree").token_ids) == 1


# -- a think block before the grammar --------------------------------------------------------------------------
# The demo's tokenizer has no <think> tokens: tokens it writes stand in for them. Greedy, it goes on from CODE
# with "\n    return np.mean(xs)\n\n" and more, its drafter seeing far ahead: "\n    " opens the block and
# "\n\n" closes it, within the first rounds.
CODE = "import numpy as np\n\ndef mean(xs):"
INDENT, BLANK = 264, 464


def reference_row(demo: Engine, grammar: str, think: ThinkBlock, reply: list[int]) -> torch.Tensor:
    """The mask after `reply` (emitted tokens and a node's path) by definition: everything inside the think
    block, else what a fresh matcher allows after only the tokens that follow the block."""
    ones = torch.ones(demo.vocab_size, dtype=torch.bool)
    fresh = Constraint(demo.grammar_tokenizer, grammar, demo.vocab_size)
    if not think.opened and not reply:
        row = masks(fresh, [[]])[0]
        row[think.open] = True
        return row
    if think.opened or reply[0] == think.open:
        body = reply if think.opened else reply[1:]
        if think.close not in body:
            return ones
        reply = body[body.index(think.close) + 1:]
    if fresh.matcher.try_consume_tokens(reply) != len(reply):
        return ones
    return masks(fresh, [[]])[0]


@pytest.mark.parametrize("opened", [True, False])
def test_each_node_inside_the_think_block_allows_everything_and_the_grammar_applies_after_it(demo, opened):
    grammar = json_schema_grammar(SCHEMA)
    think = ThinkBlock(INDENT, BLANK, opened)
    enc = demo.tokenizer.encode
    words, json_start = enc("The plan"), enc('{"ok": tr')
    paths = [[], words, [BLANK], [BLANK, *json_start], [*words, BLANK, *json_start], [*words, BLANK, *enc("nope")],
             [INDENT], [INDENT, *words], [INDENT, BLANK, *json_start], [INDENT, *words, BLANK], json_start]
    for emitted in ([], [INDENT], [INDENT, *words], [INDENT, *words, BLANK, *enc('{"ok"')]):
        constraint = Constraint(demo.grammar_tokenizer, grammar, demo.vocab_size, think)
        constraint.consume(emitted)
        got = masks(constraint, paths)
        for path, row in zip(paths, got, strict=True):
            assert torch.equal(row, reference_row(demo, grammar, think, emitted + path)), (emitted, path)
    fresh = Constraint(demo.grammar_tokenizer, grammar, demo.vocab_size, think)
    first = masks(fresh, [[]])[0]
    assert first.all() if opened else first[INDENT] and first.sum() < demo.vocab_size  # else: grammar or opening
    assert masks(fresh, [[INDENT] if not opened else words])[0].all()
    json_row = masks(fresh, [[INDENT, *words, BLANK] if not opened else [*words, BLANK]])[0]
    assert 0 < json_row.sum() < demo.vocab_size and not json_row[BLANK] and not fresh.finished


def think_params(opened: bool, close: int = BLANK, **kw) -> SamplingParams:
    return SamplingParams(grammar=json_schema_grammar(SCHEMA), think=ThinkBlock(INDENT, close, opened), **kw)


def after_block(demo: Engine, tokens: list[int], close: int = BLANK) -> str:
    return demo.decode(tokens[tokens.index(close) + 1:])


class Checked(Constraint):
    """A constraint that checks every mask it computes against `reference_row`; `crossed` collects the depths
    below the root at which a path closed the block that the emitted tokens had not closed yet."""

    demo: Engine
    crossed: set[int]
    emitted: tuple[int, ...] = ()

    def allowed(self, pending: list[list[int]]) -> torch.Tensor:
        rows = super().allowed(pending)
        unpacked = unpack(rows, self.vocab_size)
        close, inside = self.think.close, self.think.close not in self.emitted[not self.think.opened:]
        for path, row in zip(pending, unpacked, strict=True):
            assert torch.equal(row, reference_row(self.demo, self.grammar, self.think, [*self.emitted, *path]))
            if inside and close in path:
                self.crossed.add(list(path).index(close))
        return rows

    def consume(self, tokens: list[int]) -> None:
        super().consume(tokens)
        self.emitted += tuple(tokens)


@pytest.mark.parametrize("opened", [True, False])
def test_trees_crossing_the_close_at_any_depth_give_constrained_ar_output(demo, monkeypatch, opened):
    """Every node's mask during real rounds equals its definition, and ddtree and dflash equal ar, with the
    block closing at each token of the first line the demo writes."""
    code, crossed = demo.encode(CODE), set()

    def constraint(params: SamplingParams) -> Checked:
        checked = Checked(demo.grammar_tokenizer, params.grammar, demo.vocab_size, params.think)
        checked.demo, checked.grammar, checked.crossed = demo, params.grammar, crossed
        return checked

    for close in demo.tokenizer.encode(" return np.mean(xs)\n\n"):
        params = think_params(opened, close, max_new_tokens=60)
        ar = demo.generate(code, params, method="ar")
        assert ar.finish_reason == "stop" and ar.token_ids[0] == INDENT
        assert matches_schema(after_block(demo, ar.token_ids, close))
        with monkeypatch.context() as patch:
            patch.setattr(demo, "constraint", constraint)
            for method, budget in (("dflash", None), ("ddtree", 4), ("ddtree", 32)):
                assert demo.generate(code, params, method=method, budget=budget).token_ids == ar.token_ids
    assert crossed >= {0, 1, 2, 3}, crossed


def test_sampled_replies_think_freely_then_write_valid_json(demo):
    closed, code = 0, demo.encode(CODE)
    for seed in range(6):
        out = demo.generate(code, think_params(True, max_new_tokens=80, temperature=1.0, seed=seed),
                            method="ddtree", budget=16)
        if BLANK in out.token_ids:
            closed += 1
            assert out.finish_reason == "stop" and matches_schema(after_block(demo, out.token_ids)), seed
    assert closed >= 3


def test_a_block_that_never_closes_leaves_the_reply_unconstrained_up_to_max_tokens(demo):
    never = ThinkBlock(INDENT, demo.tokenizer.convert_tokens_to_ids("<|im_start|>"), opened=True)
    params = SamplingParams(max_new_tokens=30, grammar=json_schema_grammar(SCHEMA), think=never)
    code = demo.encode(CODE)
    out = demo.generate(code, params, method="ddtree", budget=8)
    free = demo.generate(code, SamplingParams(max_new_tokens=30), method="ar")
    assert out.finish_reason == "length" and out.token_ids == free.token_ids


def test_the_fast_path_thinks_before_the_grammar_as_the_reference_does(demo):
    fast, code = Engine.from_pretrained(device="cpu", fast=True), demo.encode(CODE)
    for opened in (True, False):
        params = think_params(opened, max_new_tokens=60)
        want = demo.generate(code, params, method="ar").token_ids
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 8)):
            gen = fast.stream(code, params, method=method, budget=budget)
            assert gen.backend.name == "fast"
            list(gen)
            assert gen.token_ids == want, (opened, method)


def test_packed_masks_unpack_bit_by_bit():
    """Masks travel packed as llguidance writes them: bit j of int32 word w allows token 32 w + j."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), generator=gen, dtype=torch.int32)
    want = torch.tensor([[(int(bits[r, t // 32]) >> (t % 32)) & 1 for t in range(150)] for r in range(3)],
                        dtype=torch.bool)
    assert torch.equal(unpack(bits, 150), want)
