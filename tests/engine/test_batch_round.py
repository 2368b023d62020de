"""The batch's round on the device (fast/batch_round.py) is lossless and takes only what it can.

Run eagerly on the CPU (attention through SDPA over a layout read back from the device buffers), and once with
every kernel in Triton's interpreter, as a GPU's graph replays them: each greedy request decodes exactly what it
decodes alone, whatever joins and leaves the batch (`dflash` chains beside trees and `ar`); sampled ones draw the
target's own distribution; requests the device round does not take (seeded samples, top-p without top-k, logprobs)
send their rounds to the host path.
"""

import numpy as np
import pytest
import torch
from batching import draft_nodes_while_all_run
from ddtree.core.blocks import BlockManager
from ddtree.core.budget import CostModel
from ddtree.core.sampling import SamplingParams
from ddtree.engine.batch import BatchEngine
from ddtree.engine.serial import SerialBackend
from ddtree.fast.batch import PagedBackend
from ddtree.fast.batch_round import DeviceRound
from ddtree.switches import override
from distributions import exact_joint, fit_p_value

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
PROMPTS = [[1, 2, 3], list(range(4, 40)), [8, 9], list(range(10, 60)), [13], list(range(20, 30)) * 3]


def paged(engine, *, blocks: int = 96, max_num_seqs: int = 6, max_rows: int = 256,
          cost: CostModel | None = None) -> BatchEngine:
    pool = BlockManager(blocks, 8)
    backend = PagedBackend(engine.target, engine.draft, engine.draft_head, pool, max_seqs=max_num_seqs,
                           max_rows=max_rows, device_round=True, **({"cost": cost} if cost else {}))
    return BatchEngine(engine, [backend, SerialBackend(engine.reference)], max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_rows, blocks=pool)


@pytest.fixture
def counted(monkeypatch):
    """How many device rounds ran, and how many requests they held in all."""
    calls = {"rounds": 0, "requests": 0}
    replay = DeviceRound.replay

    def counting(self, starts, *args):
        calls["rounds"] += 1
        calls["requests"] += len(starts)
        return replay(self, starts, *args)

    monkeypatch.setattr(DeviceRound, "replay", counting)
    return calls


def decode(batch: BatchEngine, requests: list[tuple[list[int], SamplingParams, str, int | None]],
           joining: int = 0) -> list:
    """Every request to the end; the last `joining` of them join once the others have decoded a few rounds."""
    first = len(requests) - joining
    seqs = [batch.add(p, params, method=m, budget=b) for p, params, m, b in requests[:first]]
    for _ in range(4):
        batch.step()
    seqs += [batch.add(p, params, method=m, budget=b) for p, params, m, b in requests[first:]]
    while batch.has_work():
        batch.step()
    return seqs


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_requests_on_the_device_round_decode_what_they_decode_alone(engines, arch, counted):
    engine = engines[arch]
    methods = [("ddtree", 8), ("ar", None), ("ddtree", 32), ("dflash", None), ("ddtree", 16), ("dflash", None)]
    requests = [(p, GREEDY, m, b) for p, (m, b) in zip(PROMPTS, methods, strict=True)]
    batch = paged(engine)
    seqs = decode(batch, requests, joining=2)
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids
    assert counted["rounds"] > 5 and counted["requests"] > counted["rounds"]  # batched rounds on the device
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


def test_greedy_requests_keep_their_tokens_beside_sampled_ones_in_a_device_round(engines, counted):
    """Unseeded requests that sample at a temperature share device rounds with greedy ones (ddtree and ar each):
    the greedy requests' tokens stay the target's own, and every request gets all its tokens."""
    engine = engines["qwen3"]
    torch.manual_seed(0)
    sampled = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.9)
    methods = [(GREEDY, "ddtree", 8), (sampled, "ddtree", 16), (GREEDY, "ar", None), (sampled, "ar", None),
               (GREEDY, "ddtree", 32), (sampled, "ddtree", 4)]
    requests = [(prompt, *how) for prompt, how in zip(PROMPTS, methods, strict=True)]
    batch = paged(engine)
    seqs = decode(batch, requests, joining=2)
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        assert len(seq.generation.token_ids) == 20
        if params.greedy:
            assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids
    assert counted["rounds"] > 5 and counted["requests"] > 3 * counted["rounds"]  # all six together, mostly
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.2, top_k=4, top_p=0.8),
                                dict(temperature=0.7, top_k=3)])
def test_sampled_requests_on_the_device_round_follow_the_targets_distribution(small_vocab, counted, kw):
    """1000 unseeded requests, 64 at a time, every round on the device: their first three tokens follow the
    target's exact joint distribution under their temperature and filters (chi-square, as the host path's test)."""
    torch.manual_seed(1)
    joint = exact_joint(small_vocab.target.model, [1, 2, 3], 12, 3, **kw)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, **kw)
    batch = paged(small_vocab, blocks=512, max_num_seqs=64, max_rows=1024)
    seqs = decode(batch, [([1, 2, 3], params, "ddtree", 6)] * 1000)
    counts: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        key = tuple(seq.generation.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert counted["requests"] >= 1000 and fit_p_value(counts, joint) > 1e-4


def test_requests_the_device_round_does_not_take_send_their_rounds_to_the_host(engines, counted):
    """A seeded sampled request, one with top-p but no top-k and one asking for logprobs share the batch with
    greedy ddtree ones: while any of them runs, rounds take the host path; once they finish, the device round
    takes over."""
    engine = engines["qwen3"]
    requests = [(PROMPTS[0], GREEDY, "ddtree", 8), (PROMPTS[1], GREEDY, "ddtree", 16),
                (PROMPTS[2], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=3), "ddtree", 8),
                (PROMPTS[3], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2), "ddtree", 8),
                (PROMPTS[4], SamplingParams(max_new_tokens=6, ignore_eos=True, seed=5, temperature=0.7), "dflash",
                 None),
                (PROMPTS[5], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9), "ddtree",
                 8)]
    batch = paged(engine)
    seqs = decode(batch, requests)
    for (prompt, params, method, budget), seq in zip(requests, seqs, strict=True):
        if params.greedy:
            assert seq.generation.token_ids == engine.generate(prompt, params, method=method,
                                                               budget=budget).token_ids
    assert all(len(seq.generation.token_ids) == 6 for seq in seqs[2:])
    assert 0 < counted["requests"] <= 2 * counted["rounds"]  # the two greedy ones, after the short ones finished
    with override(device_round=False):
        counted["rounds"] = 0
        decode(paged(engine), requests[:2])
    assert counted["rounds"] == 0


def test_the_device_round_verifies_smaller_trees_when_verified_rows_cost_time(engines):
    """Under a cost model where rows cost more than what they add, the batch picks a smaller tree size from its
    requests' trees of the round before the last (chosen while the last one still runs), and the same tokens; under
    a flat one, every request's own budget."""
    engine = engines["qwen3"]
    requests = [([i, i + 1, i + 2], GREEDY, "ddtree", 16) for i in range(1, 5)]
    steep, steep_nodes = draft_nodes_while_all_run(paged(engine, cost=CostModel(((4, 1.0), (200, 197.0)))), requests)
    flat, flat_nodes = draft_nodes_while_all_run(paged(engine), requests)
    assert all(s.generation.token_ids == f.generation.token_ids for s, f in zip(steep, flat, strict=True))
    assert max(flat_nodes) == 4 * 16 and max(steep_nodes[2:]) < 4 * 16  # sized from the round before the last


def test_the_device_round_weighs_tree_sizes_by_the_rounds_measured_times(engines):
    """capture_all times every bucket's round (every bucket a batch of up to max_num_seqs requests pads to) at
    every tree size and plain (no tree), where the batch budget is on; the size choice weighs those times: where
    they say each node costs as much as the round, rounds verify small trees; where every size costs the same,
    each request's whole tree. Same tokens."""
    engine = engines["qwen3"]
    requests = [([i, i + 1, i + 2], GREEDY, "ddtree", 16) for i in range(1, 5)]

    def nodes_under(seconds) -> tuple[list, list[int]]:
        batch = paged(engine)
        device_round = batch.backends[0].device_round
        with torch.inference_mode():
            device_round.capture_all(16, repeats=1)
        assert set(device_round.seconds) == ({(b, n, 16) for b in (1, 2, 4, 6) for n in (1, 2, 4, 8, 16)}
                                             | {(b, 0, 0) for b in (1, 2, 4, 6)})  # and the plain rounds
        device_round.seconds = {key: seconds(key[1]) for key in device_round.seconds}
        backend = batch.backends[0]
        assert device_round.predicted(3, [4, 8], 16).tolist() == [seconds(4) + backend.cost.overhead,
                                                                 seconds(8) + backend.cost.overhead]
        rows = np.array([device_round.rows(3, 4)])  # a budget no round was measured at: the cost model's time
        assert device_round.predicted(3, [4], 32).tolist() == backend.cost.seconds_at(rows, 3).tolist()
        return draft_nodes_while_all_run(batch, requests)

    untimed = paged(engine).backends[0].device_round  # without the batch budget: captured, not timed
    with torch.inference_mode():
        untimed.capture_all(16, repeats=0)
    assert untimed._rounds and not untimed.seconds
    steep, steep_nodes = nodes_under(lambda nodes: 1.0 + nodes)
    flat, flat_nodes = nodes_under(lambda nodes: 1.0)
    assert all(s.generation.token_ids == f.generation.token_ids for s, f in zip(steep, flat, strict=True))
    assert max(flat_nodes) == 4 * 16 and max(steep_nodes[2:]) <= 4 * 4


def test_a_round_near_the_context_end_drafts_only_what_fits(engines):
    """Requests decoding up to the last position of the target's context (1,024 here): their trees and chains stop
    at its end, and their output is the target's own to the last token."""
    engine = engines["qwen3"]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    requests = [([3 + (i * 7 + k) % 90 for i in range(990 + k)], params, method, budget)
                for k, method, budget in ((0, "ddtree", 16), (5, "ddtree", 16), (3, "dflash", None))]
    batch = paged(engine, blocks=300, max_rows=128)
    seqs = decode(batch, requests)
    for (prompt, p, method, budget), seq in zip(requests, seqs, strict=True):
        assert len(prompt) + len(seq.generation.token_ids) >= engine.max_context - engine.block_size
        assert seq.generation.token_ids == engine.generate(prompt, p, method=method, budget=budget).token_ids


def test_the_next_round_is_queued_before_the_host_takes_this_ones_results(engines, counted):
    """Overlap: each step reads the round queued the step before and queues the next, so the device runs it while
    the host takes the tokens. Requests that stop on a token, are aborted or preempted while a round is queued for
    them, and requests that join, still decode what they decode alone; the queued round of one that ended is dropped,
    and no round is queued past a request's token limit."""
    engine = engines["qwen3"]
    alone = engine.generate(PROMPTS[1], GREEDY, method="ddtree", budget=8).token_ids
    stops = SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(alone[9],))
    requests = [(PROMPTS[0], GREEDY, "ddtree", 8), (PROMPTS[1], stops, "ddtree", 8), (PROMPTS[2], GREEDY, "ar", None),
                (PROMPTS[3], GREEDY, "dflash", None), (PROMPTS[4], GREEDY, "ddtree", 16),
                (PROMPTS[5], GREEDY, "ddtree", 4)]
    batch = paged(engine, blocks=18)  # too few blocks for all six: the newest running ones are preempted
    device_round = batch.backends[0].device_round
    seqs = [batch.add(p, params, method=m, budget=b) for p, params, m, b in requests[:5]]
    for _ in range(3):
        batch.step()
    assert device_round.queued is not None and all(device_round.queues(seq.seq_id) for seq in seqs[:2])
    batch.abort(seqs[0])
    seqs.append(batch.add(*requests[5][:2], method=requests[5][2], budget=requests[5][3]))
    steps = 0
    while batch.has_work():
        batch.step()
        steps += 1
    assert device_round.queued is None or not any(device_round.queues(seq.seq_id) for seq in seqs)
    assert seqs[0].generation.finish_reason == "abort"
    assert seqs[1].generation.finish_reason == "stop" and len(seqs[1].generation.token_ids) < 10
    assert any(seq.preemptions for seq in seqs)
    for (prompt, params, method, budget), seq in list(zip(requests, seqs, strict=True))[1:]:
        assert seq.generation.token_ids == engine.generate(prompt, params, method=method, budget=budget).token_ids
    assert counted["rounds"] >= steps // 2 and batch.blocks.free_blocks == batch.blocks.num_blocks
    with override(overlap=False):
        off = paged(engine)
        decode(off, requests[2:])
        assert off.backends[0].device_round.queued is None


@pytest.mark.slow
def test_the_interpreted_kernels_run_the_device_round_as_the_gpu_replays(small_engine, kernels_on_cpu, counted):
    """Vocabulary top-k, the tree build, the picks (a filtered sample's too) and paged attention in Triton's
    interpreter, on the round's static buffers."""
    engine = small_engine
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, top_k=3, top_p=0.9)
    requests = [(PROMPTS[0], params, "ddtree", 8), (PROMPTS[1], params, "ar", None),
                (PROMPTS[2], params, "dflash", None), (PROMPTS[3], sampled, "ddtree", 8)]
    batch = paged(engine, blocks=32, max_num_seqs=4, max_rows=64)
    assert batch.backends[0].static
    seqs = decode(batch, requests)
    for (prompt, p, method, budget), seq in zip(requests, seqs, strict=True):
        assert len(seq.generation.token_ids) == 6
        if p.greedy:
            assert seq.generation.token_ids == engine.generate(prompt, p, method=method, budget=budget).token_ids
    assert counted["rounds"] > 0
    # `ar` requests alone verify a row each, in one-row tiles (tile_rows): on the device (plain rounds: no draft
    # pass, no tree) or, where the host picks (logprobs), in the host path's "decode" graphs
    backend = batch.backends[0]
    logprobs = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    for kw in (params, logprobs):
        alone = [(PROMPTS[4], kw, "ar", None), (PROMPTS[5], kw, "ar", None)]
        for (prompt, p, method, budget), seq in zip(alone, decode(batch, alone), strict=True):
            assert seq.generation.token_ids == engine.generate(prompt, p, method=method, budget=budget).token_ids
    plain = [r.rows.verify.block_m for r in backend.device_round._rounds.values() if r.rows.nodes == 0]
    decodes = [f.rows.block_m for (kind, _), f in backend.captured.items() if kind == "decode"]
    assert plain and decodes and set(plain) == set(decodes) == {1}


def test_a_device_rounds_result_reports_each_requests_path_and_scores(engines):
    """Accepted lengths, emitted tokens and paths agree: the path starts at the root, goes one depth a node, and
    the scores of the nodes verified are finite and best first."""
    engine = engines["qwen3"]
    batch = paged(engine)
    backend = batch.backends[0]
    seqs = [batch.add(p, GREEDY, method="ddtree", budget=8) for p in PROMPTS[:3]]
    batch.step()  # the prefills
    states = [backend.states[seq.seq_id] for seq in seqs]
    with torch.inference_mode():
        device_round = backend.device_round
        result = device_round.read(device_round.replay(
            np.array([s.start for s in states]), np.array([s.root for s in states]), np.array([8, 8, 0]),
            np.array([backend._depth(s) for s in states]), np.tile([0.0, 0.0, 1.0, 0.0], (3, 1)),
            [batch.blocks.tables[seq.seq_id] for seq in seqs], 8, 8), 3)
    assert list(result.nodes) == [8, 8, 0] and result.lengths[2] == 1
    for r in range(3):
        length = result.lengths[r]
        assert result.path[r, 0] == 0 and len(set(result.path[r, :length])) == length
        verified = result.scores[r, :result.nodes[r]]
        assert np.isfinite(verified).all() and (np.diff(verified) <= 0).all()


def test_a_dflash_request_in_a_device_round_verifies_its_chain(engines):
    """A `dflash` request beside a tree: its nodes are its chain (node j at depth j, under node j - 1, scores
    falling), cut to the round's nodes, and its accepted path walks down the chain from the root."""
    engine = engines["qwen3"]
    batch = paged(engine)
    backend = batch.backends[0]
    methods = [("ddtree", 8), ("dflash", None)]
    seqs = [batch.add(p, GREEDY, method=m, budget=b) for p, (m, b) in zip(PROMPTS[:2], methods, strict=True)]
    batch.step()  # the prefills
    states = [backend.states[seq.seq_id] for seq in seqs]
    depth = backend.block - 1
    for nodes in (4, 16):
        with torch.inference_mode():
            device_round = backend.device_round
            result = device_round.read(device_round.replay(
                np.array([s.start for s in states]), np.array([s.root for s in states]),
                np.array([min(8, nodes), nodes]),
                np.array([backend._depth(s) for s in states]), np.tile([0.0, 0.0, 1.0, 0.0], (2, 1)),
                [batch.blocks.tables[seq.seq_id] for seq in seqs], nodes, 16, np.array([False, True])), 2)
        assert result.nodes[1] == min(nodes, depth)
        length = result.lengths[1]
        assert list(result.path[1, :length]) == list(range(length))
        chain = result.scores[1, :depth]
        assert np.isfinite(chain).all() and (np.diff(chain) <= 0).all() and np.isneginf(result.scores[1, depth:]).all()
