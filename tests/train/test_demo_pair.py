"""The embedded demo pair: loads with no model given, is lossless, and keeps its measured acceptance."""

import sysconfig

import pytest
from ddtree.engine import ASSETS, Engine
from ddtree.sampling import SamplingParams
from ddtree.training.corpus import find_files, read_texts, split_files

# Measured: tau 4.05 at budget 32 on 6 held-out stdlib files x 128 tokens (benchmarks/RESULTS.md).
TAU_FLOOR_DDTREE_32 = 3.0


@pytest.fixture(scope="module")
def demo() -> Engine:
    return Engine.from_pretrained(None, device="cpu")


@pytest.fixture(scope="module")
def held_out_prompts(demo) -> list[list[int]]:
    """Beginnings of this interpreter's stdlib files that the demo pair never trained on."""
    _, held = split_files(find_files([sysconfig.get_paths()["stdlib"]], ["*.py"]))
    texts = [t for t in read_texts(held) if len(t) > 3000][:3]
    assert len(texts) == 3
    return [demo.encode(t)[:192] for t in texts]


def test_demo_pair_is_shipped_small():
    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert size < 40e6
    assert (ASSETS / "README.md").is_file()


def test_demo_ddtree_equals_ar_and_keeps_its_acceptance(demo, held_out_prompts):
    params = SamplingParams(max_new_tokens=96, ignore_eos=True)
    taus = []
    for ids in held_out_prompts:
        ar = demo.generate(ids, params, method="ar")
        tree = demo.generate(ids, params, method="ddtree", budget=32)
        assert tree.token_ids == ar.token_ids
        taus.append(tree.stats.acceptance_length)
    assert sum(taus) / len(taus) >= TAU_FLOOR_DDTREE_32, taus


def test_demo_chat_prompt_decodes_to_text(demo):
    ids = demo.encode("def fibonacci(n):", chat=True)
    out = demo.generate(ids, SamplingParams(max_new_tokens=16), method="ddtree")
    assert out.token_ids and isinstance(demo.decode(out.token_ids), str)
