"""A prompt's prefill in padded buckets and chunks (fast/prompt.py, replayed as CUDA graphs on a GPU) fills the
caches and picks the first token as the eager prefill does: here the same padded steps run eagerly on the CPU."""

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.fast.prompt import PromptGraphs, bucket_for, chunk_lengths

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
BUCKETS = (4, 8, 12)


def test_buckets_and_chunks():
    assert [bucket_for(n, BUCKETS) for n in (1, 4, 5, 9, 12)] == [4, 4, 8, 12, 12]
    assert chunk_lengths(30, 12) == [12, 12, 6]
    assert chunk_lengths(24, 12) == [12, 12]
    assert chunk_lengths(3, 12) == [3]


@pytest.fixture
def bucketed(pairs):
    """The qwen3 fast engine with its prompt in the test's buckets (eager on the CPU), put back afterwards."""
    reference, fast = pairs["qwen3"]
    path = fast.fast
    before = path.prompt_graphs
    path.prompt_graphs = PromptGraphs(path, BUCKETS)
    path.prompt_graphs.ids.fill_(7)  # stale ids in the padding: a real row that saw them would change
    yield reference, fast
    path.prompt_graphs = before


def _prefill(path, prompt: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The first token and the target's and drafter's cache rows the prompt filled."""
    n = len(prompt)
    root = path.prefill(torch.tensor(prompt), with_draft=True)[0]
    assert int(path.start) == n
    return root, path.kv[:, :, :, :n].clone(), path.draft_kv[:, :, :, :n].clone()


@pytest.mark.parametrize("length", [1, 5, 12, 30])
def test_bucketed_prefill_fills_the_caches_and_picks_the_token_of_the_eager_one(bucketed, length):
    _, fast = bucketed
    path = fast.fast
    prompt = [(3 * i + length) % 90 + 1 for i in range(length)]
    graphs, path.prompt_graphs = path.prompt_graphs, None
    want = _prefill(path, prompt)
    path.prompt_graphs = graphs
    got = _prefill(path, prompt)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # row counts differ: an ulp may
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("method", "budget"), [("ar", None), ("ddtree", 8)])
def test_bucketed_prefill_decodes_the_reference_paths_tokens(bucketed, method, budget):
    reference, fast = bucketed
    for prompt in ([17], [1, 2, 3, 4, 5], list(range(60, 90))):  # one bucket, padded; three chunks
        gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
        list(gen)
        assert gen.backend.name == "fast"
        assert gen.token_ids == reference.generate(prompt, GREEDY, method=method, budget=budget).token_ids


def test_a_prompt_whose_padding_would_pass_the_caches_is_prefilled_eagerly(bucketed):
    _, fast = bucketed
    path = fast.fast
    cap = path.capacity
    graphs = path.prompt_graphs = PromptGraphs(path, (8, 24))
    assert graphs.fits(cap - 24, 16) and not graphs.fits(cap - 16, 16)  # padded to 24 rows, past the caches
    ran = []
    step = graphs._step
    graphs._step = lambda bucket: ran.append(bucket) or step(bucket)
    prompt = [(5 * i) % 90 + 1 for i in range(cap - 6)]
    assert not graphs.fits(0, len(prompt))  # its last chunk, padded, would end past the caches
    want = _prefill(path, prompt)
    assert ran == []
    _prefill(path, prompt[:30])
    assert ran == [24, 8]
    path.prompt_graphs = None
    assert _prefill(path, prompt)[0] == want[0]
