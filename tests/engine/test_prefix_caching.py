"""Prefix caching is lossless: a request whose prompt starts with a cached prefix prefills only the rest and
decodes exactly what it decodes alone, through eviction, preemption and cancellation of requests that share
blocks; a hybrid's restored states equal those of recomputing the prefix; salts keep tenants apart."""

import pytest
import torch
from ddtree.core.blocks import BlockManager
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.batch import BatchEngine
from ddtree.engine.sequence import Status
from ddtree.engine.serial import SerialBackend
from ddtree.fast.batch import PagedBackend
from tiny import make_draft, make_hybrid_target

GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
SYSTEM = [(5 * i) % 80 + 3 for i in range(45)]  # a shared prefix of 5 full blocks and a bit
TURNS = [[1, 2, 3], list(range(20, 31)), [9], list(range(40, 47)), [7, 7]]
METHODS = [("ddtree", 8), ("dflash", None), ("ar", None), ("ddtree", 32), ("ddtree", 3)]


def paged(engine: Engine, *, blocks: int = 64, max_num_seqs: int = 4, max_num_batched_tokens: int = 128,
          caching: bool = True, checkpoints: tuple[int, int] | None = None) -> BatchEngine:
    """`checkpoints`: a hybrid's (slots, blocks between them), instead of what memory would choose."""
    pool = BlockManager(blocks, 8, prefix_caching=caching)
    if checkpoints is not None:
        pool.prefix.keep_states(*checkpoints)
    backend = PagedBackend(engine.target, engine.draft, engine.draft_head, pool, max_seqs=max_num_seqs,
                           max_rows=max_num_batched_tokens)
    return BatchEngine(engine, [backend, SerialBackend(engine.reference)], max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, blocks=pool)


def drain(batch: BatchEngine) -> tuple[int, int]:
    """Step until idle; returns the prefix cache's (queried, hit) tokens over those steps."""
    queries = hits = 0
    while batch.has_work():
        batch.step()
        queries, hits = queries + batch.last.prefix_queries, hits + batch.last.prefix_hits
    return queries, hits


def alone(engine: Engine, prompt: list[int], params: SamplingParams, method: str, budget: int | None) -> list[int]:
    return engine.generate(prompt, params, method=method, budget=budget).token_ids


@pytest.mark.parametrize("arch", ["qwen3", "llama", "moe"])
def test_prompts_sharing_a_prefix_decode_what_they_decode_without_the_cache(engines, arch):
    """One request fills the cache; then every method, concurrently, over the same prefix: each prefills only
    its own turn (the 40 cached tokens are hits) and decodes token for token what it decodes alone."""
    engine = engines[arch]
    batch = paged(engine)
    first = batch.add(SYSTEM + TURNS[0], GREEDY)
    assert drain(batch) == (len(SYSTEM) + 3, 0)
    requests = [(SYSTEM + turn, method, budget) for turn, (method, budget) in zip(TURNS, METHODS, strict=True)]
    seqs = [batch.add(prompt, GREEDY, method=method, budget=budget) for prompt, method, budget in requests]
    queries, hits = drain(batch)
    assert hits == 40 * len(requests) and queries == sum(len(p) for p, _, _ in requests)
    assert first.generation.token_ids == alone(engine, SYSTEM + TURNS[0], GREEDY, "ddtree", None)
    for (prompt, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.cached_prompt == 40 and seq.status is Status.FINISHED
        assert seq.generation.token_ids == alone(engine, prompt, GREEDY, method, budget), (method, budget)
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


def test_the_last_prompt_token_is_always_computed(engines):
    """A prompt that is exactly its cached blocks still prefills its last block, whose last row picks the first
    token; a request asking for prompt logprobs prefills its whole prompt."""
    engine = engines["qwen3"]
    batch = paged(engine)
    prompt = SYSTEM[:40]
    batch.add(prompt, GREEDY)
    drain(batch)
    again = batch.add(prompt, GREEDY)
    assert drain(batch) == (40, 32)
    assert again.generation.token_ids == alone(engine, prompt, GREEDY, "ddtree", None)
    logprobs = SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=1)
    batch.add(prompt, logprobs)
    assert drain(batch) == (0, 0)


def test_different_salts_never_share_a_block(engines):
    engine = engines["qwen3"]
    batch = paged(engine)
    a = batch.add(SYSTEM, GREEDY, cache_salt="tenant-a")
    drain(batch)
    b = batch.add(SYSTEM, GREEDY, cache_salt="tenant-b")
    batch.step()
    unsalted = batch.add(SYSTEM, GREEDY)
    batch.step()
    a_again = batch.add(SYSTEM, GREEDY, cache_salt="tenant-a")
    batch.step()
    assert (b.cached_prompt, unsalted.cached_prompt, a_again.cached_prompt) == (0, 0, 40)
    tables = [set(batch.blocks.tables[s.seq_id]) for s in (b, unsalted)]
    assert not tables[0] & tables[1]
    drain(batch)
    for seq in (a, b, unsalted, a_again):
        assert seq.generation.token_ids == alone(engine, SYSTEM, GREEDY, "ddtree", None)


def test_cached_blocks_are_evicted_under_memory_pressure_without_changing_any_output(engines):
    """A pool that holds about two requests: each new prefix evicts older cached blocks (least recently used
    first), and every output is still the request's own."""
    engine = engines["qwen3"]
    batch = paged(engine, blocks=20, max_num_seqs=2)
    prompts = [[(p + 7 * i) % 90 + 3 for i in range(50)] for p in (0, 30, 0, 60, 30)]
    results = []
    for prompt in prompts:
        seq = batch.add(prompt, GREEDY)
        drain(batch)
        results.append(seq)
    assert results[2].cached_prompt == 48  # its prefix was still cached
    assert results[4].cached_prompt < 48  # evicted by the two prefixes after it, at least in part
    for prompt, seq in zip(prompts, results, strict=True):
        assert seq.generation.token_ids == alone(engine, prompt, GREEDY, "ddtree", None)
    assert batch.blocks.free_blocks == 20


def test_preempting_a_request_whose_blocks_others_share(engines):
    """Requests that share a prefix outgrow a small pool: the newest is preempted while the others still hold
    its prefix blocks, is recomputed (hitting them again) and gives the same output; every block comes back."""
    engine = engines["qwen3"]
    batch = paged(engine, blocks=18, max_num_seqs=3)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    batch.add([*SYSTEM, 1], GREEDY)
    drain(batch)
    requests = [SYSTEM + turn for turn in TURNS[:3]]
    seqs = [batch.add(prompt, params) for prompt in requests]
    _, hits = drain(batch)
    assert sum(seq.preemptions for seq in seqs) > 0
    assert hits > 40 * len(seqs)  # the recomputed request hit the shared prefix again
    for prompt, seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == alone(engine, prompt, params, "ddtree", None)
    assert batch.blocks.free_blocks == 18
    assert all(ref == 0 for ref in batch.blocks._refs)


def test_cancelling_a_request_whose_blocks_others_share(engines):
    """An aborted request gives back its own blocks at once; the prefix it shares stays with the others and in
    the cache."""
    engine = engines["qwen3"]
    batch = paged(engine)
    batch.add(SYSTEM, GREEDY)
    drain(batch)
    keep, cancel = batch.add(SYSTEM + TURNS[1], GREEDY), batch.add(SYSTEM + TURNS[3], GREEDY)
    batch.step()
    batch.step()
    shared = batch.blocks.tables[keep.seq_id][:5]
    assert batch.blocks.tables[cancel.seq_id][:5] == shared
    batch.abort(cancel)
    assert cancel.seq_id not in batch.blocks.tables and all(batch.blocks._refs[b] == 1 for b in shared)
    drain(batch)
    assert keep.generation.token_ids == alone(engine, SYSTEM + TURNS[1], GREEDY, "ddtree", None)
    late = batch.add(SYSTEM + TURNS[4], GREEDY)
    drain(batch)
    assert late.cached_prompt == 40
    assert late.generation.token_ids == alone(engine, SYSTEM + TURNS[4], GREEDY, "ddtree", None)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Engine:
    root = tmp_path_factory.mktemp("prefix_hybrid")
    make_draft(root / "draft", taps=[1, 2])
    make_hybrid_target(root / "qwen3_5", "qwen3_5")
    return Engine.from_pretrained(root / "qwen3_5", root / "draft", device="cpu")


def test_a_hybrid_hit_restores_the_states_of_recomputing_its_prefix(hybrid):
    """Checkpoints every two blocks: a prompt sharing 45 tokens resumes from the checkpoint after 32 (the last
    boundary inside the shared part), and once its prefill is done its recurrent and conv states equal those of
    a run without the cache."""
    cached, fresh = paged(hybrid, checkpoints=(4, 2)), paged(hybrid, caching=False)
    cached.add(SYSTEM + TURNS[0], GREEDY)
    drain(cached)
    prompt = SYSTEM + TURNS[1]
    hit, miss = cached.add(prompt, GREEDY), fresh.add(prompt, GREEDY)
    cached.step()
    fresh.step()
    assert hit.cached_prompt == 32 and miss.cached_prompt == 0
    pools = [batch.backends[0].hybrid.pool for batch in (cached, fresh)]
    slots = [pool.slots[seq.seq_id] for pool, seq in zip(pools, (hit, miss), strict=True)]
    torch.testing.assert_close(pools[0].state[:, slots[0]], pools[1].state[:, slots[1]], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pools[0].conv[:, slots[0]], pools[1].conv[:, slots[1]], rtol=1e-4, atol=1e-5)
    drain(cached)
    drain(fresh)
    assert hit.generation.token_ids == miss.generation.token_ids == alone(hybrid, prompt, GREEDY, "ddtree", None)


@pytest.mark.parametrize("pressure", [False, True])
def test_hybrid_prompts_sharing_a_prefix_decode_what_they_decode_alone(hybrid, pressure):
    """Every method over one cached prefix on a hybrid, with checkpoints every block; under pressure, two
    checkpoint slots and a pool that preempts and evicts."""
    blocks, slots = (16, 2) if pressure else (40, 16)
    batch = paged(hybrid, blocks=blocks, checkpoints=(slots, 1), max_num_seqs=3)
    batch.add(SYSTEM, GREEDY)
    drain(batch)
    requests = [(SYSTEM + turn, method, budget) for turn, (method, budget) in zip(TURNS, METHODS, strict=True)]
    seqs = [batch.add(prompt, GREEDY, method=method, budget=budget) for prompt, method, budget in requests]
    _, hits = drain(batch)
    if pressure:
        assert hits > 0 and sum(seq.preemptions for seq in seqs) > 0
    else:
        assert hits >= 40 * len(requests)
    for (prompt, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == alone(hybrid, prompt, GREEDY, method, budget), (method, budget)
    assert batch.blocks.free_blocks == blocks


def test_a_hybrid_checkpoints_every_prompt_piece_by_default(hybrid):
    """Without a chosen interval the states are checkpointed every PROMPT_CHUNK tokens, one checkpoint slot per
    sequence: a long shared prefix hits at its last piece boundary."""
    from ddtree.fast.hybrid import PROMPT_CHUNK

    batch = paged(hybrid, blocks=160, max_num_batched_tokens=512)
    prefix = [(11 * i) % 90 + 3 for i in range(PROMPT_CHUNK + 40)]
    assert batch.blocks.prefix.every * 8 == PROMPT_CHUNK and batch.blocks.prefix.checkpoint_slots == 4
    batch.add([*prefix, 1], GREEDY)
    drain(batch)
    again = batch.add([*prefix, 2], GREEDY)
    drain(batch)
    assert again.cached_prompt == PROMPT_CHUNK
    assert again.generation.token_ids == alone(hybrid, [*prefix, 2], GREEDY, "ddtree", None)
