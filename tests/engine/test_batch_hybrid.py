"""Hybrid targets batch losslessly: every request in a batch decodes what it decodes alone.

A hybrid's Gated DeltaNet layers keep one state per sequence (fast/paged_hybrid.py); a batch mixes prompt lengths
(one longer than the recurrent layers' prompt piece), methods and budgets, and small pools and token budgets force
preemption and chunked prefill, so states are built over several steps, dropped and rebuilt.
"""

import numpy as np
import pytest
import torch
from ddtree.core.blocks import BlockManager
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.batch import BatchEngine, BatchOptions
from ddtree.engine.sequence import Status
from ddtree.engine.serial import SerialBackend
from ddtree.fast.batch import PagedBackend
from ddtree.fast.hybrid import PROMPT_CHUNK
from tiny import make_draft, make_hybrid_target

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
PROMPTS = [[1, 2, 3], list(range(4, 40)), [8, 9], [(7 * i) % 90 + 3 for i in range(PROMPT_CHUNK + 20)], [13]]
METHODS = [("ddtree", 8), ("dflash", None), ("ar", None), ("ddtree", 32), ("ddtree", 3)]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict[str, Engine]:
    root = tmp_path_factory.mktemp("batch_hybrid")
    make_draft(root / "draft", taps=[1, 2])
    out = {}
    for seed, arch in enumerate(["qwen3_5", "qwen3_5_moe", "qwen3_next"]):
        make_hybrid_target(root / arch, arch, seed=seed)
        out[arch] = Engine.from_pretrained(root / arch, root / "draft", device="cpu")
    return out


@pytest.fixture(scope="module")
def small_hybrids(tmp_path_factory) -> dict[str, Engine]:
    """For the interpreted kernels (every node of a verify runs a program per head in each Gated DeltaNet layer):
    two Gated DeltaNet layers (still a layer axis for the varlen and commit kernels to index) and a full-attention
    one, under a one-layer draft."""
    root = tmp_path_factory.mktemp("batch_hybrid_small")
    make_draft(root / "draft", target_layers=3, layers=1, taps=[0, 2])
    out = {}
    for seed, arch in enumerate(["qwen3_5", "qwen3_next"]):
        make_hybrid_target(root / arch, arch, seed=seed, layers=3)
        out[arch] = Engine.from_pretrained(root / arch, root / "draft", device="cpu")
    return out


def batch_of(engine: Engine, *, blocks: int = 96, max_num_seqs: int = 4,
             max_num_batched_tokens: int = 512) -> BatchEngine:
    pool = BlockManager(blocks, 8)
    backend = PagedBackend(engine.target, engine.draft, engine.draft_head, pool, max_seqs=max_num_seqs,
                           max_rows=max_num_batched_tokens)
    return BatchEngine(engine, [backend, SerialBackend(engine.reference)], max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, blocks=pool)


def decode(batch: BatchEngine, requests: list[tuple[list[int], str, int | None]]) -> list:
    seqs = [batch.add(prompt, GREEDY, method=method, budget=budget) for prompt, method, budget in requests]
    while batch.has_work():
        batch.step()
    return seqs


def alone(engine: Engine, prompt: list[int], method: str, budget: int | None) -> list[int]:
    return engine.generate(prompt, GREEDY, method=method, budget=budget).token_ids


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_every_request_of_a_hybrid_batch_decodes_what_it_decodes_alone(hybrids, arch):
    engine = hybrids[arch]
    requests = [(p, m, b) for p, (m, b) in zip(PROMPTS, METHODS, strict=True)]
    batch = batch_of(engine)
    seqs = decode(batch, requests)
    for (prompt, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.backend.name == "fast" and seq.status is Status.FINISHED
        assert seq.generation.token_ids == alone(engine, prompt, method, budget), (method, budget, len(prompt))
    backend = batch.backends[0]
    assert batch.blocks.free_blocks == batch.blocks.num_blocks and not backend.hybrid.pool.slots
    assert sorted(backend.hybrid.pool.free) == list(range(4))


def test_preempted_and_chunked_hybrid_requests_rebuild_their_states(hybrids):
    """A pool too small for every sequence and a token budget that cuts prompts into chunks: states are built
    over several steps, given up on preemption and rebuilt from the prompt and what was emitted."""
    engine = hybrids["qwen3_5"]
    requests = [(p, m, b) for p, (m, b) in zip(PROMPTS, METHODS, strict=True)]
    batch = batch_of(engine, blocks=48, max_num_batched_tokens=64)
    seqs = decode(batch, requests)
    assert sum(seq.preemptions for seq in seqs) > 0
    for (prompt, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == alone(engine, prompt, method, budget), (method, budget, len(prompt))


def test_after_a_batched_round_each_state_is_the_one_its_sequence_has_alone(hybrids):
    """The verify leaves the states alone and the commit installs each sequence's state after its accepted
    path: after batched rounds every sequence's recurrent and conv states equal those the single-sequence fast
    path builds from the same committed tokens."""
    engine = hybrids["qwen3_5"]
    fast = Engine(engine.target, engine.draft, engine.tokenizer, fast=True, fast_capacity=256).fast
    batch = batch_of(engine)
    backend = batch.backends[0]
    seqs = [batch.add(p, GREEDY, method=m, budget=b) for p, (m, b) in zip(PROMPTS[:3], METHODS[:3], strict=True)]
    for _ in range(4):
        batch.step()
    pool = backend.hybrid.pool
    for seq in seqs:
        committed = backend.states[seq.seq_id].start  # the prompt and emitted tokens but the newest (the root)
        tokens = torch.tensor((list(seq.request.prompt_ids) + seq.generation.token_ids)[:committed])
        fast.start.zero_()  # a new sequence for the single-sequence path
        assert committed > len(seq.request.prompt_ids)  # rounds have run
        causal = torch.ones(committed, committed, dtype=torch.bool).tril()
        fast.prompt_forward(tokens, torch.arange(committed), causal)
        slot = pool.slots[seq.seq_id]  # float32 round-off apart: a GEMM's sums depend on how many rows it takes
        torch.testing.assert_close(pool.state[:, slot], fast.recurrent_state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool.conv[:, slot], fast.conv_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels", ["pytorch", "interpreted"])
def test_the_commit_installs_the_state_after_any_node_as_the_single_sequence_commit_does(small_hybrids, kernels,
                                                                                        request):
    """Two sequences verify a tree each in one batched forward; the commit then takes each to a deep node of its
    tree (not the walk's choice: random drafts are rarely accepted). Every recurrent state and conv window equals
    what the single-sequence fast path's verify and commit give for that sequence and node: with each sequence's
    recurrent layers in PyTorch, and with all of them in the varlen kernels (interpreted) on static buffers."""
    from ddtree.core.tree import tree_from_candidates, visibility
    from ddtree.fast.batch_trees import RoundTrees
    from ddtree.kernels.paged_attention import PagedLayout

    if kernels == "interpreted":
        request.getfixturevalue("kernels_on_cpu")
    engine = small_hybrids["qwen3_5"]
    fast = Engine(engine.target, engine.draft, engine.tokenizer, fast=True, fast_capacity=256).fast
    batch = batch_of(engine)
    backend = batch.backends[0]
    assert backend.static == (kernels == "interpreted")
    prompts = [PROMPTS[1], PROMPTS[0]]
    seqs = [batch.add(p, GREEDY, method="ddtree", budget=16) for p in prompts]
    batch.step()  # the prompts go in whole
    seq_ids = [seq.seq_id for seq in seqs]
    gen = torch.Generator().manual_seed(3)
    trees = []
    for depth in (5, 7):
        logp = torch.log_softmax(torch.randn(depth, 4, generator=gen), -1).sort(descending=True).values.tolist()
        trees.append(tree_from_candidates(logp, torch.randint(3, 90, (depth, 4), generator=gen).tolist(), 12))
    ids, positions, slots, layout = [], [], [], PagedLayout([], [0], [], [])
    for seq_id, prompt, tree in zip(seq_ids, prompts, trees, strict=True):
        state = backend.states[seq_id]
        assert state.start == len(prompt)
        backend.blocks.ensure(seq_id, state.start + tree.size + 1)
        ids += [state.root, *tree.tokens]
        positions += [state.start, *(state.start + d for d in tree.depths)]
        slots += backend.blocks.slots(seq_id, state.start, tree.size + 1)
        backend._describe(layout, seq_id, state.start, visibility(tree))
    rows = backend._seq_rows(seq_ids, layout, RoundTrees.of(trees))
    record = backend.hybrid.record(rows)
    backend._run("verify", ids, positions, slots, layout, rows, record)
    lasts = [max(range(tree.size + 1), key=lambda i: (tree.depths[i - 1] if i else 0, i)) for tree in trees]
    assert min(lasts) > 1
    backend.hybrid.commit(record, rows, lasts)
    pool = backend.hybrid.pool
    for seq_id, prompt, tree, last in zip(seq_ids, prompts, trees, lasts, strict=True):
        n = len(prompt)
        fast.start.zero_()
        fast.prompt_forward(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        root = backend.states[seq_id].root
        visible = visibility(tree)
        _, _, rec = fast.forward(torch.tensor([root, *tree.tokens]), torch.tensor([n, *(n + d for d in tree.depths)]),
                                 visible)
        fast._commit_recurrent(rec, torch.tensor(last))
        slot = pool.slots[seq_id]
        torch.testing.assert_close(pool.state[:, slot], fast.recurrent_state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool.conv[:, slot], fast.conv_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_the_interpreted_kernels_batch_a_hybrid_as_the_gpu_replays(small_hybrids, kernels_on_cpu, arch):
    """The static buffers, the paged attention kernel and the varlen Gated DeltaNet kernels (Triton's
    interpreter), as a GPU's graphs run a hybrid's verify: Qwen3.5's fused input projection, and Qwen3-Next's
    two projections reordered into the rows the kernels read."""
    engine = small_hybrids[arch]
    batch = batch_of(engine, blocks=48, max_num_batched_tokens=64)
    backend = batch.backends[0]
    assert backend.static and backend.hybrid.varlen
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)  # (Qwen3-Next's tree accepts a token in its third round)
    longer = SamplingParams(max_new_tokens=8, ignore_eos=True)  # its last rounds alone: one row, one-row tiles
    requests = [(PROMPTS[0], "ddtree", 8, params), (PROMPTS[1], "dflash", None, params),
                (PROMPTS[2], "ar", None, longer)]
    seqs = [batch.add(prompt, p, method=method, budget=budget) for prompt, method, budget, p in requests]
    while batch.has_work():
        batch.step()
    for (prompt, method, budget, p), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, p, method=method, budget=budget).token_ids
    assert [f.rows.block_m for (kind, _), f in backend.captured.items() if kind == "decode"] == [1]


def test_the_cost_model_of_a_hybrid_is_measured_within_its_trees_rows_and_leaves_the_states_alone(hybrids):
    """The server measures a round's cost before any request: a hybrid's verify samples hold at most
    gdn.TREE_MAX rows a sequence (what its varlen kernels take), and reading the empty state slots changes none."""
    from ddtree.kernels import gdn

    backend = batch_of(hybrids["qwen3_5"], max_num_seqs=2, max_num_batched_tokens=512).backends[0]
    cost = backend.measure_cost(repeats=1)
    rows = [r for r, _ in cost.points]
    assert rows and max(rows) <= 2 * gdn.TREE_MAX
    assert not backend.hybrid.pool.state.any() and not backend.hybrid.pool.conv.any()


def test_the_memory_the_server_budgets_for_a_hybrid_is_what_the_pools_take(hybrids):
    """The server sizes the KV cache from what is left after the states (pool_tokens): a state slot's bytes are
    what the pool allocates per sequence, and a cache slot counts the attention layers' K/V only."""
    from ddtree.fast.batch_memory import slot_bytes
    from ddtree.fast.paged_hybrid import RecurrentPool

    engine = hybrids["qwen3_5"]
    backend = batch_of(engine).backends[0]
    pool = backend.hybrid.pool
    per_sequence = pool.conv[:, 0].numel() * pool.conv.element_size() + pool.state[:, 0].numel() * 4
    assert RecurrentPool.bytes_per_sequence(engine.target) == per_sequence
    kv = backend.kv
    assert slot_bytes(engine.target, None) == kv[:, :, :, 0].numel() * kv.element_size()
    assert kv.shape[0] == len(backend.hybrid.hybrid.attention_index) < len(engine.target.layers)


def test_the_batchs_conv_windows_are_each_sequences_own():
    """conv_windows (every row of a batch at once, on the host) equals fast.delta.conv_sources per sequence:
    trees, a chain, a lone root, at a conv width of 4 and of 2."""
    from ddtree.fast.delta import conv_sources
    from ddtree.fast.paged_hybrid import SeqRows, conv_windows
    from trees import ancestry, random_tree

    gen = torch.Generator().manual_seed(5)
    shapes = [random_tree(9, gen), [-1], [-1, *range(11)], random_tree(30, gen)]
    seqs, lo = [], 0
    for parents in shapes:
        visible, depths = ancestry(parents)
        seqs.append(SeqRows(0, lo, lo + len(parents), visible, np.array(parents), depths.numpy()))
        lo += len(parents)
    for width in (4, 2):
        want = torch.cat([conv_sources(s.visible, torch.from_numpy(s.depths), width) for s in seqs])
        assert torch.equal(conv_windows(seqs, width), want)


def test_a_lone_hybrid_request_whose_prefix_is_cached_prefills_only_the_rest_on_the_batched_path(hybrids):
    """The single path keeps a hybrid's recurrent states in caches of its own, with no checkpoints to resume from:
    a lone request whose prompt starts with a cached prefix decodes batched instead, prefilling only the rest (from
    the checkpoint after the prefix's first prompt piece); one that hits nothing decodes alone."""
    engine = hybrids["qwen3_5"]
    fast = Engine(engine.target, engine.draft, engine.tokenizer, fast=True, fast_capacity=512)
    batch = fast.batch(BatchOptions(max_num_seqs=4, max_num_batched_tokens=512, kv_cache_tokens=1024))
    shared = [(7 * i) % 90 + 3 for i in range(PROMPT_CHUNK + 20)]
    decode(batch, [([*shared, 1], "ddtree", None), ([9, 8], "ddtree", None)])  # together: batched, cached
    hit, = decode(batch, [([*shared, 2], "ddtree", None)])
    miss, = decode(batch, [(list(range(50, 60)), "ddtree", None)])
    assert not batch.solo.paged and miss.backend is batch.solo
    assert isinstance(hit.backend, PagedBackend) and hit.cached_prompt == PROMPT_CHUNK
    assert hit.generation.token_ids == alone(engine, [*shared, 2], "ddtree", None)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_a_hybrids_trees_in_a_batch_reach_past_the_varlen_kernels_narrow_tiles(hybrids, arch):
    """Budgets up to gdn.VARLEN_MAX - 1 nodes hold in a batch (no longer 63): a request verifies trees of more
    than gdn.TREE_MAX rows beside others, and every request decodes what it decodes alone."""
    from ddtree.kernels import gdn

    engine = hybrids[arch]
    batch = batch_of(engine, max_num_batched_tokens=512)
    assert batch.backends[0].max_tree == gdn.VARLEN_MAX - 1
    requests = [(PROMPTS[1], "ddtree", 120), (PROMPTS[0], "ddtree", 8), (PROMPTS[2], "ar", None)]
    seqs = [batch.add(prompt, GREEDY, method=method, budget=budget) for prompt, method, budget in requests]
    widest = 0
    while batch.has_work():
        batch.step()
        widest = max(widest, batch.last.draft_nodes - 8)  # the budget-8 tree's at most 8 of the step's nodes
    assert widest > gdn.TREE_MAX
    for (prompt, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == alone(engine, prompt, method, budget), (method, budget)


@pytest.mark.slow  # the interpreter runs the 128-row tiles: about a minute on one core
def test_the_interpreted_kernels_verify_a_tree_past_their_narrow_tiles_as_the_gpu_replays(hybrids, kernels_on_cpu):
    """A tree of more than gdn.TREE_MAX rows in the varlen kernels' 128-row tiles (Triton's interpreter, the
    'wide verify' static rows a GPU replays as graphs): the request still decodes what it decodes alone."""
    engine = hybrids["qwen3_5"]
    batch = batch_of(engine, blocks=48, max_num_batched_tokens=256)
    backend = batch.backends[0]
    assert backend.static and backend.hybrid.varlen
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    requests = [(PROMPTS[4], "ddtree", 100), (PROMPTS[2], "ar", None)]
    seqs = [batch.add(prompt, params, method=method, budget=budget) for prompt, method, budget in requests]
    while batch.has_work():
        batch.step()
    assert any(kind == "wide verify" for kind, _ in backend.captured)
    for (prompt, _, _), seq in zip(requests, seqs, strict=True):  # greedy: the target's own tokens
        assert seq.generation.token_ids == engine.generate(prompt, params, method="ar").token_ids
