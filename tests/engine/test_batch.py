"""Continuous batching is lossless: every request in a batch decodes exactly what it decodes alone.

The batched fast path (fast/batch.py) runs here eagerly on the CPU, with attention through SDPA over each
sequence's gathered pages, and once with every kernel in Triton's interpreter (the static buffers a GPU
replays as CUDA graphs). Batches mix lengths, methods, budgets, sampling settings, grammars and stop ids;
small pools force preemption, small token budgets chunked prefill.
"""

import pytest
import torch
from batching import draft_nodes_while_all_run
from ddtree.core.blocks import BlockManager
from ddtree.core.budget import CostModel
from ddtree.core.grammar import json_schema_grammar
from ddtree.core.sampling import SamplingParams
from ddtree.engine.batch import BatchEngine, BatchOptions
from ddtree.engine.sequence import Status
from ddtree.engine.serial import SerialBackend
from ddtree.fast.batch import PagedBackend
from distributions import exact_joint, fit_p_value
from tiny import make_draft

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3], list(range(4, 40)), [8, 9], list(range(10, 80)), [13], list(range(20, 30)) * 3]
METHODS = [("ddtree", 8), ("dflash", None), ("ar", None), ("ddtree", 32), ("ddtree", 3), ("dflash", None)]


def paged(engine, *, blocks: int = 64, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
          cost: CostModel | None = None) -> BatchEngine:
    pool = BlockManager(blocks, 8)
    backend = PagedBackend(engine.target, engine.draft, engine.draft_head, pool, max_seqs=max_num_seqs,
                           max_rows=max_num_batched_tokens, **({"cost": cost} if cost else {}))
    return BatchEngine(engine, [backend, SerialBackend(engine.reference)], max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, blocks=pool)


def run(batch: BatchEngine, requests: list[tuple[list[int], SamplingParams, str, int | None]]) -> list:
    seqs = [batch.add(prompt, params, method=method, budget=budget) for prompt, params, method, budget in requests]
    while batch.has_work():
        batch.step()
    return seqs


@pytest.mark.parametrize("arch", ["qwen3", "llama", "moe"])
def test_every_request_in_a_batch_decodes_what_it_decodes_alone(engines, arch):
    engine = engines[arch]
    requests = [(p, GREEDY, m, b) for p, (m, b) in zip(PROMPTS, METHODS, strict=True)]
    batch = paged(engine)
    seqs = run(batch, requests)
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.backend.name == "fast" and seq.status is Status.FINISHED
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


def test_preempted_requests_are_recomputed_and_give_the_same_output(engines):
    """A pool too small for every sequence at once: the newest running sequences give their blocks up and
    are recomputed later from their prompt and what they emitted."""
    engine = engines["qwen3"]
    requests = [(p, GREEDY, m, b) for p, (m, b) in zip(PROMPTS, METHODS, strict=True)]
    batch = paged(engine, blocks=16)
    seqs = run(batch, requests)
    assert sum(seq.preemptions for seq in seqs) > 0
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids
    assert batch.blocks.free_blocks == 16


def test_chunked_prefill_equals_a_whole_prefill(engines):
    """A prompt entering over several steps (a small token budget) decodes as one prefilled whole, and its
    prompt logprobs are the same."""
    engine = engines["qwen3"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    prompt = list(range(3, 90))
    chunked = run(paged(engine, max_num_batched_tokens=16), [(prompt, params, "ddtree", 8)])[0]
    whole = run(paged(engine, max_num_batched_tokens=256), [(prompt, params, "ddtree", 8)])[0]
    alone = engine.generate(prompt, params, method="ddtree", budget=8)
    assert chunked.generation.token_ids == whole.generation.token_ids == alone.token_ids


def test_prompt_logprobs_and_logprobs_in_a_batch_equal_the_reference(engines):
    engine = engines["qwen3"]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    batch = paged(engine, max_num_batched_tokens=16)
    seq = batch.add(list(range(3, 40)), params, method="ddtree", budget=8)
    outs = []
    while batch.has_work():
        outs += [out for s, out in batch.step() if s is seq]
    ref = list(engine.stream(list(range(3, 40)), params, method="ddtree", budget=8))
    got_prompt = outs[0].prompt_logprobs
    want_prompt = ref[0].prompt_logprobs
    assert [e and e.token_id for e in got_prompt] == [e and e.token_id for e in want_prompt]
    assert all(g is None or (g.rank == w.rank and g.logprob == pytest.approx(w.logprob, abs=1e-4))
               for g, w in zip(got_prompt, want_prompt, strict=True))
    got = [e for out in outs for e in out.logprobs]
    want = [e for out in ref for e in out.logprobs]
    assert [e.token_id for e in got] == [e.token_id for e in want]
    assert all(g.logprob == pytest.approx(w.logprob, abs=1e-4) for g, w in zip(got, want, strict=True))


def test_mixed_settings_in_one_batch(engines):
    """Penalties, logit bias, a grammar, stop ids and a seeded sample, each in its own request of one batch:
    each gives what it gives alone."""
    engine = engines["qwen3"]
    full = engine.generate([1, 2, 3], GREEDY, method="ar").token_ids
    settings = [
        SamplingParams(max_new_tokens=20, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(max_new_tokens=20, ignore_eos=True, logit_bias=((5, 3.0), (7, -2.0))),
        SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(full[6],)),
        SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=3),
    ]
    requests = [([1, 2, 3], params, "ddtree", 8) for params in settings]
    seqs = run(paged(engine, max_num_seqs=5), requests)
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        alone = engine.generate(prompt, params, method=method, budget=budget)
        if params.greedy:
            assert seq.generation.token_ids == alone.token_ids
            assert seq.generation.finish_reason == alone.finish_reason
        else:  # a seed fixes a request's draws, not the tree shapes a batch gives it: only the support is checked
            assert len(seq.generation.token_ids) == 20


def test_a_grammar_in_a_batch_constrains_only_its_request():
    pytest.importorskip("llguidance")
    from ddtree.engine import Engine

    engine = Engine.from_pretrained(device="cpu")  # the demo pair: a tokenizer the grammar reads
    schema = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    constrained = SamplingParams(max_new_tokens=30, grammar=schema)
    prompt = engine.encode("def f(x):\n    return")
    seqs = run(paged(engine), [(prompt, constrained, "ddtree", 8), (prompt, GREEDY, "ddtree", 8)])
    assert seqs[0].generation.token_ids == engine.generate(prompt, constrained, budget=8).token_ids
    assert seqs[1].generation.token_ids == engine.generate(prompt, GREEDY, budget=8).token_ids
    assert seqs[0].generation.token_ids != seqs[1].generation.token_ids


def test_an_aborted_request_frees_its_blocks_at_once(engines):
    engine = engines["qwen3"]
    batch = paged(engine)
    long, short = batch.add(list(range(5, 60)), GREEDY), batch.add([1, 2], GREEDY)
    for _ in range(3):
        batch.step()
    assert long.seq_id in batch.blocks.tables
    held = len(batch.blocks.tables[long.seq_id])
    free = batch.blocks.free_blocks
    batch.abort(long)
    assert long.status is Status.FINISHED and batch.blocks.free_blocks == free + held
    while batch.has_work():
        batch.step()
    assert short.generation.token_ids == engine.generate([1, 2], GREEDY).token_ids
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


def test_a_request_larger_than_the_cache_is_refused_in_one_line(engines):
    from ddtree.errors import DDTreeError

    batch = paged(engines["qwen3"], blocks=4)
    with pytest.raises(DDTreeError, match="KV cache slots"):
        batch.add(list(range(40)), GREEDY)


def test_prompts_with_ids_outside_the_vocabulary_are_refused_in_one_line(engines):
    from ddtree.errors import DDTreeError

    batch = paged(engines["qwen3"], blocks=16)
    vocab = engines["qwen3"].vocab_size
    for bad in ([1, vocab, 2], [-1, 3], [], [vocab + 7]):
        with pytest.raises(DDTreeError, match=r"must be in \[0, |is empty"):
            batch.add(bad, GREEDY)
    assert batch.add([0, vocab - 1], GREEDY).request.prompt_ids == [0, vocab - 1]


def test_the_batch_budget_shrinks_trees_when_verified_tokens_cost_time(engines):
    """Under a cost model where every verified row costs as much as a round's fixed part, the batch verifies
    fewer draft nodes a step than the requests' own budgets add up to, and still gives their tokens."""
    engine = engines["qwen3"]
    requests = [([i, i + 1, i + 2], GREEDY, "ddtree", 16) for i in range(1, 5)]
    steep, steep_nodes = draft_nodes_while_all_run(
        paged(engine, max_num_batched_tokens=256, cost=CostModel(((4, 1.0), (200, 197.0)))), requests)
    flat, flat_nodes = draft_nodes_while_all_run(paged(engine, max_num_batched_tokens=256), requests)
    assert all(s.generation.token_ids == f.generation.token_ids for s, f in zip(steep, flat, strict=True))
    assert max(flat_nodes) == 4 * 16 and max(steep_nodes) < 4 * 16


def test_batch_options_refuse_nonsense_in_one_line():
    from ddtree.errors import DDTreeError

    for bad in (dict(max_num_seqs=0), dict(max_num_batched_tokens=2, max_num_seqs=4),
                dict(gpu_memory_utilization=1.5), dict(block_size=12)):
        with pytest.raises(DDTreeError):
            BatchOptions(**bad)


@pytest.mark.slow
def test_sampling_inside_a_batch_follows_the_targets_distribution(small_vocab):
    """1000 seeded requests decoded 64 at a time: the first three sampled tokens follow the target's exact
    joint distribution (chi-square, as the single-request test)."""
    kw = dict(temperature=0.8, top_p=0.8, top_k=0)
    joint = exact_joint(small_vocab.target.model, [1, 2, 3], 12, 3, **kw)
    batch = paged(small_vocab, blocks=512, max_num_seqs=64, max_num_batched_tokens=1024)
    seqs = run(batch, [([1, 2, 3], SamplingParams(max_new_tokens=3, seed=s, ignore_eos=True, **kw), "ddtree", 6)
                       for s in range(1000)])
    counts: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        key = tuple(seq.generation.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert fit_p_value(counts, joint) > 1e-4


def test_the_interpreted_kernels_batch_as_the_gpu_replays(small_engine, kernels_on_cpu):
    """The static buffers and the paged attention kernel (Triton's interpreter), as a GPU's graphs run them."""
    engine = small_engine
    requests = [(p, SamplingParams(max_new_tokens=10, ignore_eos=True), m, b)
                for p, (m, b) in zip(PROMPTS[:3], METHODS[:3], strict=True)]
    batch = paged(engine, blocks=24)
    assert batch.backends[0].static
    seqs = run(batch, requests)
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids


@pytest.mark.parametrize("draft", ["draft_swa", "draft_dflash2", "draft_sinks"])
def test_every_drafter_kind_batches_on_the_paged_path(fast_ckpt, draft):
    """A sliding-window drafter (causal inside the block by the checkpoint rule) batches on the paged path with
    each layer's own block mask; a DFlash2 drafter with its convolutions (each block on its own) and its
    selector's chain and trees; a drafter with every 2026 field (attention sinks in each layer's softmax, the
    embedding scale, the output multiplier and softcap). All decode the target's tokens."""
    from ddtree.engine import Engine

    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / draft, device="cpu")
    requests = [(p, GREEDY, m, b) for p, (m, b) in zip(PROMPTS[:4], METHODS[:4], strict=True)]
    seqs = run(paged(engine), requests)
    drafting = [seq for seq, (_, _, method, _) in zip(seqs, requests, strict=True) if method != "ar"]
    assert {seq.backend.name for seq in drafting} == {"fast"}
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids


def test_a_dflash2_batch_drafts_what_each_request_drafts_alone(fast_ckpt):
    """The batched DFlash2 block pass (one pass for every request's block, each block convolved on its own) gives
    each request the transition model, and so the selector tree, its block gives in a pass of its own."""
    from ddtree.core.tree import selector_tree_from_sorted
    from ddtree.engine import Engine

    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft_dflash2", device="cpu")
    batch = paged(engine)
    backend = batch.backends[0]
    seqs = [batch.add(p, GREEDY, method="ddtree", budget=12) for p in PROMPTS[:3]]
    batch.step()  # the prompts go in whole
    ids = [seq.seq_id for seq in seqs]
    states = [backend.states[i] for i in ids]
    for i, state in zip(ids, states, strict=True):
        backend.blocks.ensure(i, state.start + backend.block)
    together = backend._draft(ids, states, list(range(len(ids))))
    for b, (i, state) in enumerate(zip(ids, states, strict=True)):
        alone = backend._draft([i], [state], [0])
        for got, want in zip(together, alone, strict=True):
            torch.testing.assert_close(got[b], want[0], rtol=1e-5, atol=1e-5)
        trees = [selector_tree_from_sorted(o[0].double().tolist(), r[0].tolist(), t[0].tolist(), 12)
                 for o, r, t in ((alone[0], alone[1], alone[2]),
                                 (together[0][b:b + 1], together[1][b:b + 1], together[2][b:b + 1]))]
        assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents


@pytest.mark.parametrize("draft", ["draft_dflash2", "draft_sinks"])
def test_the_interpreted_kernels_batch_dflash2_and_sink_drafters_as_the_gpu_replays(small_ckpt, kernels_on_cpu, draft):
    """The DFlash2 block pass on static buffers (its convolutions per block, the selector's transitions from the
    pass's normed rows), and a drafter whose layers have attention sinks (the paged kernel's sink column), with
    the paged attention kernel interpreted, as a GPU's draft graphs run them."""
    from ddtree.engine import Engine

    engine = Engine.from_pretrained(small_ckpt / "qwen3", small_ckpt / draft, device="cpu")
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    requests = [(PROMPTS[0], params, "ddtree", 8), (PROMPTS[1], params, "dflash", None)]
    batch = paged(engine, blocks=24)
    assert batch.backends[0].static and batch.backends[0].selector == (draft == "draft_dflash2")
    seqs = run(batch, requests)
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.backend.name == "fast"
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids


@pytest.mark.parametrize(("target", "draft", "reason"), [
    ("qwen3", "draft", None),
    ("qwen3", "draft_swa", None),
    ("qwen3", "draft_dflash2", None),
    ("qwen3", "draft_sinks", None),
    ("qwen3_5", "draft", None),
    ("qwen3_next", "draft", None),
])
def test_pairs_the_paged_path_cannot_batch_are_named(fast_ckpt, tmp_path, target, draft, reason):
    """What the paged fast path would hand to the eager reference path is known before any request comes, so a
    GPU server decodes those pairs one at a time on its fast path instead, and says why."""
    from ddtree.engine import Engine
    from tiny import make_hybrid_target

    if target.startswith("qwen3_"):  # hybrids: their Gated DeltaNet layers batch in the varlen kernels
        make_hybrid_target(tmp_path / target, target)
        make_draft(tmp_path / "draft", taps=[1, 2])
        engine = Engine.from_pretrained(tmp_path / target, tmp_path / "draft", device="cpu")
    else:
        engine = Engine.from_pretrained(fast_ckpt / target, fast_ckpt / draft, device="cpu")
    said = PagedBackend.declines(engine.target, engine.draft)
    if reason is None:
        assert said is None or "kernel" in said  # a CPU without Triton: the kernel check alone
    else:
        assert reason in said


def test_rounds_that_do_not_draft_leave_every_request_lossless(engines):
    """Where drafting does not pay, a round runs as a plain step for every request (RoundChoice); the drafter's
    context still takes each committed token, so the drafting rounds after it draft from the whole context."""
    from ddtree.core.budget import RoundChoice

    class EveryOther(RoundChoice):
        def drafts(self, requests: int) -> bool:
            self.rounds += 1
            return self.rounds % 2 == 0

    engine = engines["qwen3"]
    batch = paged(engine)
    batch.backends[0].choice = choice = EveryOther()
    requests = [(p, GREEDY, m, b) for p, (m, b) in zip(PROMPTS, METHODS, strict=True)]
    seqs = run(batch, requests)
    assert choice.rounds > 10 and choice.draft_seconds and choice.plain_seconds  # both kinds ran and were timed
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids
    drafted = [s for s, (m, _) in zip(seqs, METHODS, strict=True) if m != "ar"]
    assert any(s.generation.stats.committed_tokens > s.generation.stats.rounds for s in drafted)

    def context_after(choice: RoundChoice | None) -> tuple[torch.Tensor, int]:
        """The drafter's cached context of one request after 8 steps, and how many tokens it holds."""
        batch = paged(engine)
        batch.backends[0].choice = choice
        seq = batch.add(PROMPTS[1], GREEDY, method="ddtree", budget=8)
        batch.add(PROMPTS[3], GREEDY, method="dflash")
        for _ in range(8):
            batch.step()
        backend = batch.backends[0]
        start = backend.states[seq.seq_id].start
        return backend.draft_kv[:, :, :, backend.blocks.slots(seq.seq_id, 0, start)], start

    every, start = context_after(None)
    alternate, other = context_after(EveryOther())
    common = min(start, other)
    assert common > len(PROMPTS[1]) + 4
    torch.testing.assert_close(alternate[..., :common, :], every[..., :common, :], rtol=1e-4, atol=1e-5)


def test_the_budgets_calibration_counts_every_accepted_draft_token(engines):
    """Each drafting round tells the batch budget's calibration which verified nodes the target accepted: over a
    run (no decay) it has counted exactly the accepted draft tokens the rounds report."""
    batch = paged(engines["qwen3"])
    backend = batch.backends[0]
    backend.calibration.decay = 1.0
    accepted, step = [], backend.step

    def counting(*args):
        rounds = step(*args)
        accepted.extend(r.accepted for r in rounds.values() if not r.is_prefill)
        return rounds

    backend.step = counting
    run(batch, [(p, GREEDY, m, b) for p, (m, b) in zip(PROMPTS[:4], METHODS[:4], strict=True)])
    assert sum(accepted) > 0 and backend.calibration.accepted.sum() == sum(accepted)
    assert backend.calibration.forecast.sum() > 0
