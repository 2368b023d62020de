"""A request alone in the batch engine decodes on the single-request fast path; when others arrive it moves to the
batched path, and every request still decodes exactly what it decodes alone.

The fast path runs eagerly on the CPU here (a GPU replays the same steps as CUDA graphs).
"""

from dataclasses import replace

import pytest
import torch
from ddtree.core.prefix_cache import block_hashes
from ddtree.core.sampling import SamplingParams
from ddtree.engine.batch import BatchEngine, BatchOptions, alone_lengths
from ddtree.engine.sequence import Status
from ddtree.fast.batch import PagedBackend
from ddtree.kernels.attention import launch_config

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def batch_of(engine, **options) -> BatchEngine:
    return engine.batch(BatchOptions(max_num_seqs=4, max_num_batched_tokens=128, kv_cache_tokens=1024, **options))


def finish(batch: BatchEngine) -> None:
    while batch.has_work():
        batch.step()


@pytest.mark.parametrize(("method", "budget"), [("ddtree", 8), ("dflash", None), ("ar", None)])
def test_a_request_alone_decodes_on_the_single_request_path(pairs, method, budget):
    _, engine = pairs["qwen3"]
    batch = batch_of(engine)
    seq = batch.add([5, 6, 7], GREEDY, method=method, budget=budget)
    finish(batch)
    assert seq.backend is batch.solo and seq.status is Status.FINISHED
    assert seq.generation.token_ids == engine.generate([5, 6, 7], GREEDY, method=method, budget=budget).token_ids
    assert seq.generation.stats.rounds < len(seq.generation.token_ids) or method == "ar"


@pytest.mark.parametrize("steps_alone", [1, 2, 5])
@pytest.mark.parametrize(("method", "budget"), [("ddtree", 8), ("dflash", None), ("ar", None)])
def test_a_lone_request_joins_the_batch_when_others_arrive_and_its_output_is_unchanged(pairs, method, budget,
                                                                                        steps_alone):
    """After its prefill (1 step) or some rounds alone, a second and third request come in: the first moves to the
    batched path (recomputed from its context there), and all three give their own output."""
    _, engine = pairs["qwen3"]
    batch = batch_of(engine)
    first = batch.add(list(range(3, 20)), GREEDY, method=method, budget=budget)
    for _ in range(steps_alone):
        batch.step()
    assert first.backend is batch.solo and first.generation.token_ids
    others = [batch.add([9, 8, 7], GREEDY, method="ddtree", budget=4), batch.add([2], GREEDY, method="dflash")]
    batch.step()
    assert isinstance(first.backend, PagedBackend) and all(isinstance(s.backend, PagedBackend) for s in others)
    finish(batch)
    for seq, (prompt, m, b) in zip([first, *others], [(list(range(3, 20)), method, budget), ([9, 8, 7], "ddtree", 4),
                                                      ([2], "dflash", None)], strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, GREEDY, method=m, budget=b).token_ids
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


def test_the_next_request_alone_takes_the_single_request_path_again(pairs):
    _, engine = pairs["qwen3"]
    batch = batch_of(engine)
    together = [batch.add([4, 5], GREEDY), batch.add([6, 7], GREEDY)]
    finish(batch)
    assert all(isinstance(s.backend, PagedBackend) for s in together)
    later = batch.add([4, 5], GREEDY)
    finish(batch)
    assert later.backend is batch.solo
    assert later.generation.token_ids == together[0].generation.token_ids


def test_a_seeded_sample_and_a_request_the_single_path_cannot_hold_stay_batched(pairs):
    """A seed fixes a request's draws on the path it runs on: it stays on one path whatever else arrives. A
    request longer than the single path's static caches (256 slots here) decodes batched too."""
    _, engine = pairs["qwen3"]
    batch = batch_of(engine)
    seeded = batch.add([1, 2], SamplingParams(max_new_tokens=8, temperature=0.8, seed=3))
    finish(batch)
    assert isinstance(seeded.backend, PagedBackend)
    long = batch.add([1, 2], SamplingParams(max_new_tokens=300, ignore_eos=True))
    batch.step()
    assert isinstance(long.backend, PagedBackend)


def test_the_single_request_path_can_be_turned_off(pairs):
    _, engine = pairs["qwen3"]
    batch = batch_of(engine, single_request_path=False)
    seq = batch.add([5, 6, 7], GREEDY)
    finish(batch)
    assert batch.solo is None and isinstance(seq.backend, PagedBackend)
    assert seq.generation.token_ids == engine.generate([5, 6, 7], GREEDY).token_ids


def prompt_rows(batch: BatchEngine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's and the drafter's pool rows of the prompt's cached full blocks."""
    pool, size = batch.backends[0], batch.blocks.block_size
    blocks = [batch.blocks.prefix.block_of[h] for h in block_hashes(prompt, size)]
    slots = torch.tensor([b * size + i for b in blocks for i in range(size)])
    return pool.kv.index_select(3, slots), pool.draft_kv.index_select(3, slots)


@pytest.mark.parametrize("method", ["ddtree", "ar"])
def test_a_lone_request_leaves_its_prompt_in_the_prefix_cache_as_the_batched_path_would(pairs, method):
    """The single-request path writes its prompt's K/V (the drafter's context too, even for an ar request) into
    the pool's blocks, which join the prefix cache: the rows equal what a batched prefill writes there."""
    _, engine = pairs["qwen3"]
    prompt = list(range(3, 40))
    alone, batched = batch_of(engine), batch_of(engine, single_request_path=False)
    seqs = [alone.add(prompt, GREEDY, method=method), batched.add(prompt, GREEDY, method=method)]
    finish(alone)
    finish(batched)
    assert seqs[0].backend is alone.solo and isinstance(seqs[1].backend, PagedBackend)
    assert len(alone.blocks.prefix.block_of) == 2  # the prompt's two full blocks (16 slots each)
    for solo_rows, paged_rows in zip(prompt_rows(alone, prompt), prompt_rows(batched, prompt), strict=True):
        torch.testing.assert_close(solo_rows, paged_rows, rtol=1e-4, atol=1e-5)
    assert alone.blocks.free_blocks == alone.blocks.num_blocks  # cached, and evictable


def test_a_lone_request_prefills_only_what_the_prefix_cache_does_not_hold(pairs):
    """Requests over one 37-token prefix, each alone: the first fills the cache, another prompt runs, the next
    request skips the prefix's two full blocks on the single-request path, and one batched beside a newcomer skips
    them too; each decodes what it decodes without the cache. Prompt logprobs compute the whole prompt."""
    _, engine = pairs["qwen3"]
    batch = batch_of(engine)
    shared = list(range(3, 40))
    first = batch.add([*shared, 1], GREEDY)
    finish(batch)
    batch.add(list(range(50, 90)), GREEDY)  # the single path's caches now hold another prompt
    finish(batch)
    hit = batch.add([*shared, 2], GREEDY, method="dflash")
    finish(batch)
    together = [batch.add([*shared, 3], GREEDY, budget=4), batch.add([9, 8], GREEDY)]
    finish(batch)
    logprobs = batch.add([*shared, 4], replace(GREEDY, prompt_logprobs=1))
    finish(batch)
    assert first.backend is hit.backend is logprobs.backend is batch.solo
    assert isinstance(together[0].backend, PagedBackend)
    assert (first.cached_prompt, hit.cached_prompt, together[0].cached_prompt, logprobs.cached_prompt) == (0, 32, 32, 0)
    for seq, (prompt, method, budget) in zip([first, hit, together[0]], [([*shared, 1], "ddtree", None),
                                             ([*shared, 2], "dflash", None), ([*shared, 3], "ddtree", 4)], strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, GREEDY, method=method, budget=budget).token_ids


def test_a_lone_request_that_moves_to_the_batched_path_finds_its_prompt_cached(pairs):
    """Company arrives after a lone request's first rounds: on the batched path it recomputes only what it
    emitted, its prompt's blocks read from the cache it left them in."""
    _, engine = pairs["qwen3"]
    batch = batch_of(engine)
    prompt = list(range(3, 40))
    first = batch.add(prompt, GREEDY)
    for _ in range(3):
        batch.step()
    assert first.backend is batch.solo
    other = batch.add([9, 8, 7], GREEDY)
    batch.step()
    assert isinstance(first.backend, PagedBackend) and first.cached_prompt == 32
    finish(batch)
    assert first.generation.token_ids == engine.generate(prompt, GREEDY).token_ids
    assert other.generation.token_ids == engine.generate([9, 8, 7], GREEDY).token_ids
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


def test_without_prefix_caching_a_lone_request_holds_no_blocks(pairs):
    _, engine = pairs["qwen3"]
    batch = batch_of(engine, prefix_caching=False)
    seq = batch.add(list(range(3, 40)), GREEDY)
    batch.step()
    assert seq.backend is batch.solo and not batch.solo.paged and batch.blocks.usage == 0
    finish(batch)
    assert seq.generation.token_ids == engine.generate(list(range(3, 40)), GREEDY).token_ids


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("groups", range(1, 9))
def test_the_warm_up_lengths_reach_every_attention_build_a_prompt_can_launch(groups, head_dim):
    """A lone request's prompt forward is eager and its attention builds a kernel per launch configuration;
    every configuration a prompt of 2 to 1,600 tokens launches must be built by a warm-up length, or the first
    request of that length waits on a compile (a served TTFT of 370 ms where 30 ms is usual)."""
    def config(tokens: int) -> tuple:
        return tuple(sorted(launch_config(tokens * groups, 32768, 8, 132, head_dim).items()))

    warmed = {config(n) for n in alone_lengths(16384)}
    assert {config(n) for n in range(2, 1601)} <= warmed
    assert max(alone_lengths(40)) <= 40
