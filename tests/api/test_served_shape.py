"""`ddtree serve --shape`: a random-weight model of a published shape behind the real server, for measuring a GPU
at a model's size without its checkpoint. What a benchmark relies on: the weights are the same in every process
(seeded), the server decodes them losslessly, and a shape the tokenizer cannot drive is refused in one line."""

from __future__ import annotations

import copy
import pickle

import pytest
from ddtree.cli import main
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.models import shapes
from servers import start_server

PROMPT = "def fib(n):"


def test_a_served_shape_decodes_what_its_target_alone_decodes(tmp_path):
    server = start_server(tmp_path, "--shape", "tiny", "--device", "cpu")
    try:
        assert server.model() == "tiny"
        reply = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                                  extra_body={"ignore_eos": True})
    finally:
        server.stop()
    alone = Engine.from_shape("tiny", device="cpu", method="ar")  # another process's weights: seeded alike
    ids = alone.tokenizer.encode(PROMPT)
    expected = alone.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    assert reply.choices[0].text == alone.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(expected.token_ids) == 24


def test_a_shape_with_fewer_tokens_than_the_tokenizer_is_refused(monkeypatch):
    small = copy.deepcopy(shapes.SHAPES["tiny"])
    small["target"]["vocab_size"] = 512
    monkeypatch.setitem(shapes.SHAPES, "small-vocab", small)
    with pytest.raises(DDTreeError, match="shape small-vocab has 512 tokens, fewer than the demo tokenizer's 8192"):
        Engine.from_shape("small-vocab", device="cpu")


def test_ids_beyond_the_demo_tokenizer_decode_as_text_in_every_process(monkeypatch):
    """A shape with more ids than the demo tokenizer (Qwen3-8B's 151,936 against 8192): its tokens must still be
    text, or a stream's first chunk waits for the first id the tokenizer has and TTFT counts the wait."""
    wide = copy.deepcopy(shapes.SHAPES["tiny"])
    wide["target"]["vocab_size"] = 9000
    monkeypatch.setitem(shapes.SHAPES, "wide-vocab", wide)
    engine = Engine.from_shape("wide-vocab", device="cpu")
    front = pickle.loads(pickle.dumps(engine.tokenizer))  # as the engine process hands it to the front end
    for tokenizer in (engine.tokenizer, front):
        assert tokenizer.decode([8192 + 300, 8192 + 301]) == tokenizer.decode([300, 301]) != ""
        assert len(tokenizer) == 8192
    assert engine.encode("hello", chat=True) == Engine.from_shape("tiny", device="cpu").encode("hello", chat=True)


@pytest.mark.parametrize("args,message", [
    (["--shape", "qwen9-1t"], "unknown shape 'qwen9-1t'; choose one of qwen3-8b"),
    (["--shape", "tiny", "--target", "/models/qwen3"], "--shape serves a random-weight model: leave out --target"),
])
def test_serve_shape_user_errors_are_one_line(args, message, capsys):
    assert main(["serve", *args]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0]
