"""The fast path on a GPU: rounds replayed as CUDA graphs give the reference path's tokens (float32 exactly;
bf16 parting only at a near-tie of the reference's own logits)."""


import json
from functools import partial
from pathlib import Path

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.fast import layers
from ddtree.fast.prompt import PROMPT_BUCKETS, PromptGraphs
from ddtree.kernels.heads import attention_heads as heads_kernel
from ddtree.kernels.jit import triton_works
from ddtree.switches import override
from marks import gpu

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@gpu
@pytest.mark.parametrize(("arch", "draft"), [("qwen3", "draft"), ("llama", "draft"), ("qwen3", "draft_swa")])
def test_graphs_and_compiled_steps_give_the_reference_tokens(fast_ckpt, arch, draft):
    fast = Engine.from_pretrained(fast_ckpt / arch, fast_ckpt / draft, device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert fast.fast.ops.compiled and triton_works(fast.fast.device)  # the Triton kernels, not their fallbacks
    assert fast.fast.row_gemv  # AR steps through the fused GEMVs
    assert fast.fast.ops.attention_heads is heads_kernel
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            rounds = list(gen)
            ref = reference.stream(prompt, GREEDY, method=method, budget=budget)
            ref_rounds = list(ref)
            plan = fast.fast.plan(method, budget or 1)
            assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
            assert gen.token_ids == ref.token_ids, (method, budget)
            assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds]
    assert set(fast.fast.prompt_graphs._graphs) == {b for b in PROMPT_BUCKETS if b <= 256}  # prompts replayed


@gpu
def test_prompts_in_chunks_of_their_buckets_give_the_reference_tokens(fast_ckpt):
    """A prompt padded to its bucket, and one in chunks of the largest, each chunk a graph replay."""
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    path = fast.fast
    capture = partial(path._capture, pool=torch.cuda.graph_pool_handle())
    path.prompt_graphs = PromptGraphs(path, (8, 16), capture=capture)
    for prompt in ([3], list(range(60, 90))):  # 1 row in 8; 30 rows as 16 + 14 padded to 16
        for method, budget in (("ar", None), ("ddtree", 8)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            list(gen)
            assert gen.token_ids == reference.generate(prompt, GREEDY, method=method, budget=budget).token_ids
    assert set(path.prompt_graphs._graphs) == {8, 16}


@gpu
def test_a_draft_vocabulary_replays_as_graphs_and_gives_the_reference_tokens(fast_ckpt):
    hot = list(range(0, 96, 3))  # every third token: the trees must map draft columns back to token ids
    fast = Engine(*_loaded(fast_ckpt), fast=True, fast_capacity=256, draft_vocab=hot)
    reference = Engine(fast.target, fast.draft, fast.tokenizer, draft_vocab=hot)
    ar = Engine(fast.target, fast.draft, fast.tokenizer)
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        want = ar.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            rounds = list(gen)
            ref = reference.stream(prompt, GREEDY, method=method, budget=budget)
            ref_rounds = list(ref)
            assert gen.backend.name == "fast" and fast.fast.plan(method, budget or 1).graphs
            assert gen.token_ids == ref.token_ids == want, (method, budget)
            assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds]


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_draft_replays_as_graphs_and_gives_the_targets_tokens(fast_ckpt, dtype):
    """fp8 drafter projections in the round's graphs: the output is the reference path's `ar`, and both paths
    draft with fp8 (the fast path through the kernels, the reference through them too on CUDA)."""
    from ddtree.kernels.fp8 import Fp8Weight

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=256, draft_quantization="fp8")
    reference = Engine(fast.target, fast.draft, fast.tokenizer, draft_vocab=fast.draft_head,
                       draft_quantization="fp8")
    assert isinstance(fast.fast.fused_draft.layers[0].q.weight, Fp8Weight)
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        want = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 16), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            list(gen)
            assert gen.backend.name == "fast" and fast.fast.plan(method, budget or 1).graphs
            if gen.token_ids != want:  # bf16 only, and at a near-tie of the reference (graph_rounds_match_ar)
                assert dtype != "float32", (method, budget)
                assert reference_margin(reference, prompt, want, gen.token_ids) < NEAR_TIE, (method, budget)


def _loaded(fast_ckpt: Path) -> tuple:
    """The float32 qwen3 pair on CUDA: (target, draft, tokenizer)."""
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32")
    return engine.target, engine.draft, engine.tokenizer


@gpu
def test_the_fast_path_is_on_by_default_on_cuda(fast_ckpt):
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", fast=None)
    assert engine.fast is not None and engine.stream([1, 2, 3], GREEDY).backend.name == "fast"


@gpu
def test_without_triton_the_graphs_still_give_the_reference_tokens(fast_ckpt, monkeypatch):
    """A machine whose Triton cannot build kernels (no compiler) serves on SDPA and the PyTorch tree loop."""
    from ddtree.kernels import jit

    monkeypatch.setattr(jit, "_WORKS", {torch.device("cuda", torch.cuda.current_device()): False})
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32",
                                  fast=True, fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    for method, budget in (("dflash", None), ("ddtree", 16)):
        gen = fast.stream(list(range(60, 90)), GREEDY, method=method, budget=budget)
        list(gen)
        ref = reference.stream(list(range(60, 90)), GREEDY, method=method, budget=budget)
        list(ref)
        assert gen.backend.name == "fast" and fast.fast.plan(method, budget or 1).graphs
        assert gen.token_ids == ref.token_ids, method


@gpu
def test_dependent_launches_change_no_bits(fast_ckpt, monkeypatch):
    """On Hopper and later the Triton kernels launch as programmatic dependents: inside a graph each may start
    while the kernel before it drains, and waits for it before touching its outputs; a B = 64 tree's norms,
    heads and attention kernels let the next kernel launch before they wait (wgmma.early_pdl). The same rounds
    with early launches off, and with PDL off, give the same tokens and log-probabilities, bit for bit; a kernel
    that read another's output before its wait would race, and round AR steps (all Triton) and trees
    differently."""
    from ddtree.kernels import jit, wgmma

    if not jit.pdl(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("no programmatic dependent launch on this GPU or Triton")
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="bfloat16",
                                    fast=True, fast_capacity=256)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)

    def decode() -> list:
        engine.fast._plans.clear()  # recaptured with the current launches
        out = []
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 64)):
            gen = engine.stream(list(range(60, 90)), params, method=method, budget=budget)
            out.append([(r.token_ids, r.logprobs) for r in gen])
        return out

    assert wgmma.EARLY_STEPS
    dependent = decode()
    monkeypatch.setattr(wgmma, "EARLY_STEPS", frozenset())
    assert decode() == dependent
    with override(pdl=False):
        assert decode() == dependent


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma needs a Hopper GPU (sm_90)")
def test_the_silu_epilogue_changes_no_bit_of_a_round(fast_ckpt, monkeypatch):
    """With the fill rule off, the tiny target's tree projections run on the Hopper GEMM, and its MLPs take SiLU · up
    in the gate/up product's epilogue: the same rounds with the row kernel after the plain product give the same
    tokens and log-probabilities, bit for bit."""
    from ddtree.kernels import gemm, wgmma

    monkeypatch.setattr(wgmma, "MIN_FILL", 0.0)
    folded = []

    def counted(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        act = gemm.silu_mul_linear(x, weight)
        if act is not None:
            folded.append(x.shape[0])
        return act

    monkeypatch.setattr(layers, "silu_mul_linear", counted)
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="bfloat16",
                                    fast=True, fast_capacity=256)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)

    def decode() -> list:
        engine.fast._plans.clear()  # recaptured with the current steps
        return [[(r.token_ids, r.logprobs) for r in engine.stream(list(range(60, 90)), params, method="ddtree",
                                                                 budget=budget)] for budget in (32, 64)]

    assert engine.fast.ops.folding_silu
    with_epilogue = decode()
    assert {33, 65} <= set(folded)
    engine.fast.ops.folding_silu = False
    folded.clear()
    assert decode() == with_epilogue and not folded


@gpu
def test_sampled_rounds_replay_as_graphs_and_a_seed_fixes_the_output(fast_ckpt):
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", fast=True,
                                  fast_capacity=256)
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        gen = fast.stream([1, 2, 3, 4], params, method="ddtree", budget=16)
        list(gen)
        runs.append(gen.token_ids)
    plan = fast.fast.plan("ddtree", 16, sampled=True)
    assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
    assert runs[0] == runs[1] and len(runs[0]) == 40


@gpu
@pytest.mark.parametrize("filters", [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.2, top_p=0.95),
                                     dict(top_k=20, top_p=0.9)])
def test_filtered_sampling_is_captured_in_graphs_and_stays_in_the_filtered_support(fast_ckpt, filters):
    """top-k / top-p / min-p run inside the sampled verify graph (not eagerly), and every token drawn is one
    the reference path's own filter keeps for that context (with a hair of slack on top-p and min-p: the two
    paths' float32 logits differ in the last bits)."""
    from ddtree.core.sampling import filter_logits

    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32",
                                  fast=True, fast_capacity=256)
    params = SamplingParams(max_new_tokens=24, temperature=1.3, seed=5, ignore_eos=True, **filters)
    prompt = [1, 2, 3, 4]
    gen = fast.stream(prompt, params, method="ddtree", budget=16)
    list(gen)
    plan = fast.fast.plan_for("ddtree", 16, params)
    assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
    ids = prompt + gen.token_ids
    with torch.no_grad():
        logits = fast.target.model(torch.tensor([ids], device="cuda")).logits[0, len(prompt) - 1:-1].float()
    loose = filter_logits(logits / params.temperature, params.top_k, min(1.0, params.top_p + 0.01), 0.95 * params.min_p)
    kept = loose > float("-inf")
    drawn = torch.tensor(gen.token_ids, device="cuda")
    assert kept[torch.arange(len(drawn)), drawn].all()


@gpu
def test_penalized_rounds_with_logprobs_replay_as_graphs_and_give_the_reference_tokens(fast_ckpt):
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                            logit_bias=((5, 1.5),), logprobs=2)
    prompt = [40, 41, 42, 43, 40, 41, 42, 43]
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 16)):
        gen = fast.stream(prompt, params, method=method, budget=budget)
        got = [entry.logprob for r in gen for entry in r.logprobs]
        plan = fast.fast.plan_for(method, budget or 1, params)
        assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
        want = reference.generate(prompt, params, method=method, budget=budget)
        assert gen.token_ids == want.token_ids
        assert got == pytest.approx([entry.logprob for entry in want.logprobs], abs=1e-4)


@gpu
def test_prompt_logprobs_and_a_warmed_up_engine_on_graphs_give_the_reference_entries(fast_ckpt):
    """Prompt logprobs prefill with every row's logits and decode in graphs; a warm-up before them (what a
    server runs before it is ready) leaves nothing that changes the next request."""
    from test_agreement import prompt_logprobs_agree

    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256, method="ddtree", budget=16)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert fast.warm_up(SamplingParams()) == ["greedy"]
    params = SamplingParams(max_new_tokens=24, prompt_logprobs=3, logprobs=2, ignore_eos=True)
    prompt = list(range(40, 70))
    for method, budget in (("ar", None), ("ddtree", 16)):
        gen = fast.stream(prompt, params, method=method, budget=budget)
        rounds = list(gen)
        ref = reference.stream(prompt, params, method=method, budget=budget)
        ref_rounds = list(ref)
        plan = fast.fast.plan_for(method, budget or 1, params)
        assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
        assert gen.token_ids == ref.token_ids, method
        prompt_logprobs_agree(rounds[0].prompt_logprobs, ref_rounds[0].prompt_logprobs, tolerance=1e-4)
        got = [e.logprob for r in rounds for e in r.logprobs]
        assert got == pytest.approx([e.logprob for r in ref_rounds for e in r.logprobs], abs=1e-4)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_rounds_replay_as_graphs_and_give_the_reference_tokens(tmp_path, dtype):
    """A Qwen3-MoE target: routing, the grouped expert GEMMs (or their fixed loop, where torch's grouped GEMM
    cannot run or be captured for this dtype) and the weighted sums captured in the round's graphs. float32
    must give the reference's tokens exactly; bf16 its tokens up to rounding."""
    from tiny import make_draft, make_target

    make_target(tmp_path / "moe", "qwen3_moe", seed=4)
    make_draft(tmp_path / "draft")
    fast = Engine.from_pretrained(tmp_path / "moe", tmp_path / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=256)
    experts = fast.fast.layers[0].experts
    assert experts.kernels_take(torch.zeros(65, experts.router.shape[1], device="cuda", dtype=experts.router.dtype))
    graph_rounds_match_ar(fast, [[1, 2, 3, 4, 5], list(range(60, 90))], dtype, (tmp_path / "moe", tmp_path / "draft"))


def graph_rounds_match_ar(fast: Engine, prompts: list[list[int]], dtype: str, checkpoints: tuple[Path, Path]) -> None:
    """Every method's rounds replay from graphs and give the reference's `ar` tokens. Rounding can flip a
    near-tie in bf16, so there the tokens may part from `ar`'s, but only at a tie within rounding noise
    (`within_noise`). In float32 the tokens are `ar`'s on the CPU (the `checkpoints`, target and
    draft): on CUDA, transformers' Gated DeltaNet layers run fla's Triton kernels, whose float32 products go
    through TF32, so the GPU's own eager forward is no float32 reference (on the Qwen3-Next target its logits
    stray 0.13 from the CPU's, and its `ar` parts from the CPU's where the top two are 0.0097 apart)."""
    float32 = Engine.from_pretrained(*checkpoints, device="cpu", dtype="float32")
    reference = float32 if dtype == "float32" else Engine(fast.target, fast.draft, fast.tokenizer)
    for prompt in prompts:
        ar = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            list(gen)
            plan = fast.fast.plan(method, budget or 1)
            assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
            if gen.token_ids != ar:
                assert dtype != "float32", (method, budget)
                assert within_noise(reference, prompt, ar, gen.token_ids, float32), (method, budget)


NEAR_TIE = 0.25


def reference_margin(reference: Engine, prompt: list[int], want: list[int], got: list[int]) -> float:
    """At the first index where `got` parts from `want`, the reference's logit for want's token minus got's."""
    i = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
    ids = torch.tensor(prompt + want[:i], device=reference.target.device)
    logits = reference.target.forward(ids, torch.arange(len(ids), device=ids.device),
                                      reference.target.new_cache())[0][-1].float()
    return (logits[want[i]] - logits[got[i]]).item()


def within_noise(reference: Engine, prompt: list[int], want: list[int], got: list[int],
                 float32: Engine | None = None) -> bool:
    """Whether `got` (the fast path's bf16 tokens) parts from `want` (the bf16 reference's) only at a tie within
    rounding noise: where the reference's margin for its own token is under NEAR_TIE, or, given the float32
    reference (on the CPU, from the checkpoints), where float32's margin is under NEAR_TIE plus how far the bf16
    reference's margin strays from it there. The fast path rounds differently from the reference, so it may stray
    as far: the tiny Qwen3-Next (experts in every layer) moves a margin by 0.2-0.7 in bf16 and its bf16 reference
    parts from float32's own greedy tokens within 1-5 tokens (CPU), while a wrong forward errs by whole units
    where both references agree."""
    margin = reference_margin(reference, prompt, want, got)
    if margin < NEAR_TIE:
        return True
    if float32 is None:
        return False
    exact = reference_margin(float32, prompt, want, got)
    return exact < NEAR_TIE + abs(margin - exact)


@gpu
def test_constrained_rounds_replay_as_graphs_and_give_the_reference_tokens():
    pytest.importorskip("llguidance", reason="the server extra's llguidance (carry its wheel to the GPU machine)")
    from ddtree.core.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 9}},
              "required": ["ok", "name"], "additionalProperties": False}
    fast = Engine.from_pretrained(device="cuda", dtype="float32", fast=True)  # the demo pair: it has a tokenizer
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    ids = fast.chat_ids([{"role": "user", "content": "The status as JSON."}])
    for sampled in (False, True):
        params = SamplingParams(max_new_tokens=60, grammar=json_schema_grammar(schema), seed=1,
                                temperature=0.9 if sampled else 0.0)
        want = reference.generate(ids, params, method="ar").token_ids
        for method, budget in (("ar", None), ("ddtree", 16)):
            gen = fast.stream(ids, params, method=method, budget=budget)
            list(gen)
            plan = fast.fast.plan(method, budget or 1, sampled=sampled, constrained=True)
            assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
            assert set(json.loads(fast.decode(gen.token_ids))) == {"ok", "name"}
            if not sampled:
                assert gen.token_ids == want, method


@gpu
def test_packed_grammar_masks_unpack_on_the_device_as_on_the_host():
    from ddtree.core.grammar import unpack

    bits = torch.randint(-2**31, 2**31 - 1, (65, 4748), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    assert torch.equal(unpack(bits.cuda(), 151936).cpu(), unpack(bits, 151936))


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_hybrid_rounds_replay_as_graphs_and_give_the_reference_tokens(tmp_path, dtype, arch, monkeypatch):
    """A Qwen3.5 hybrid, and a Qwen3-Next one (experts and a shared expert in every layer): the closed-form
    Gated DeltaNet tree and its commit captured in the round's graphs (and Qwen3.5's AR steps through the
    one-row kernel, its trees of up to TREE_MAX nodes through the tree kernels): the reference's tokens up to
    its own near-ties (graph_rounds_match_ar)."""
    from ddtree.kernels import gdn
    from tiny import make_draft, make_hybrid_target

    trees, tree_step = [], gdn.tree_step
    monkeypatch.setattr(gdn, "tree_step", lambda *a: trees.append(a[1].shape[0]) or tree_step(*a))

    make_draft(tmp_path / "draft", taps=[1, 2])
    make_hybrid_target(tmp_path / "hybrid", arch, seed=0)
    fast = Engine.from_pretrained(tmp_path / "hybrid", tmp_path / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=512)
    assert bool(fast.fast.hybrid.gdn_rows) == (arch == "qwen3_5")  # Qwen3.5: the one-row Gated DeltaNet kernel
    # the second prompt: two prompt chunks
    graph_rounds_match_ar(fast, [[1, 2, 3, 4, 5], list(range(10, 80)) * 5], dtype,
                          (tmp_path / "hybrid", tmp_path / "draft"))
    assert bool(trees) == (arch == "qwen3_5") and max(trees, default=0) <= gdn.TREE_MAX


@gpu
@pytest.mark.parametrize("draft", ["draft_dflash2", "draft_sinks"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dflash2_and_2026_field_drafts_replay_as_graphs_and_give_the_targets_tokens(fast_ckpt, draft, dtype):
    """DFlash2's convolutions, transitions and selector tree, and a draft with sinks, a causal window, an embedding
    scale and a capped output, all inside the round's graphs: the reference path's rounds (float32) and the
    target's own tokens."""
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / draft, device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert triton_works(fast.fast.device)
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        want = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            rounds = list(gen)
            plan = fast.fast.plan(method, budget or 1)
            assert gen.backend.name == "fast" and plan.graphs and plan.eager_reason is None
            if dtype == "float32":
                ref = reference.stream(prompt, GREEDY, method=method, budget=budget)
                ref_rounds = list(ref)
                assert gen.token_ids == ref.token_ids == want, (method, budget)
                assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds], (method, budget)


@gpu
@pytest.mark.parametrize("draft", ["draft", "draft_dflash2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_rounds_replay_as_graphs_and_give_each_requests_tokens(fast_ckpt, dtype, draft):
    """The batch engine on the GPU: prompt chunks, every drafter block and every tree of a mixed batch, replayed
    from its bucketed CUDA graphs over the paged caches, give each request the tokens it gets alone (float32:
    exactly; bf16: parting only at a near-tie of the reference's own logits), and every block comes back. A
    DFlash2 drafter's block pass convolves each block on its own and its selector drafts every request's tree."""
    from ddtree.engine.batch import BatchOptions

    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / draft, device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=512)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    batch = fast.batch(BatchOptions(max_num_seqs=8, max_num_batched_tokens=256, kv_cache_tokens=4096))
    paged = batch.backends[0]
    assert paged.name == "fast" and paged.static and paged.captured
    batch_matches_ar(batch, reference, [[1, 2, 3, 4, 5], list(range(10, 80)) * 4, list(range(30, 60)), [7] * 40],
                     dtype)
    assert all(c.graph is not None for c in paged.captured.values())
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_greedy_rounds_run_whole_on_the_device_and_give_each_requests_tokens(fast_ckpt, dtype, monkeypatch):
    """Greedy ddtree and ar requests batched: every round is one CUDA graph (fast/batch_round.py) captured when the
    engine was built, and each request gets the reference's greedy tokens, with requests joining mid-run."""
    from ddtree.engine.batch import BatchOptions
    from ddtree.fast.batch_round import DeviceRound

    rounds = []
    replay = DeviceRound.replay
    monkeypatch.setattr(DeviceRound, "replay",
                        lambda self, starts, *more: rounds.append(len(starts)) or replay(self, starts, *more))
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=512)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    batch = fast.batch(BatchOptions(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_tokens=4096))
    paged = batch.backends[0]
    captured = dict(paged.device_round._rounds)
    assert captured and all(c.graph is not None for c in captured.values())
    prompts = [[1, 2, 3, 4, 5], list(range(10, 80)) * 4, list(range(30, 60)), [7] * 40]
    requests = [(p, r) for p in prompts for r in [("ar", None), ("ddtree", 5), ("ddtree", 32)]]
    seqs = [batch.add(p, GREEDY, method=m, budget=b) for p, (m, b) in requests[:6]]
    for _ in range(3):
        batch.step()
    seqs += [batch.add(p, GREEDY, method=m, budget=b) for p, (m, b) in requests[6:]]
    while batch.has_work():
        batch.step()
    assert len(rounds) > 10 and max(rounds) > 1
    assert set(paged.device_round._rounds) == set(captured)  # no capture while serving
    tokens_match_ar(reference, requests, seqs, dtype)
    assert batch.blocks.free_blocks == batch.blocks.num_blocks


@gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dflash_chains_in_device_rounds_give_each_requests_tokens(fast_ckpt, dtype, overlap):
    """`dflash` requests beside `ddtree` and `ar` ones on the device round, with the next round queued ahead and
    without: graphs that lay out their chains, captured on first use, replay, and every request gets the
    reference's greedy tokens."""
    from ddtree.engine.batch import BatchOptions

    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=512)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 80)) * 4, list(range(30, 60))]
    requests = [(p, r) for p in prompts for r in [("dflash", None), ("ddtree", 16), ("ar", None)]]
    with override(overlap=overlap):
        batch = fast.batch(BatchOptions(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_tokens=4096))
        seqs = [batch.add(p, GREEDY, method=m, budget=b) for p, (m, b) in requests]
        while batch.has_work():
            batch.step()
    chains = [c for key, c in batch.backends[0].device_round._rounds.items() if key[-1]]
    assert chains and all(c.graph is not None for c in chains)
    tokens_match_ar(reference, requests, seqs, dtype)
    assert batch.blocks.free_blocks == batch.blocks.num_blocks

@gpu
@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.2, top_k=4, top_p=0.8)])
def test_sampled_requests_in_device_rounds_follow_the_targets_distribution(tmp_path, kw):
    """1000 unseeded requests through the batch's captured device rounds (Philox draws inside the picking kernel, a
    fresh seed each round; with filters, their floor from each row's ranked logits): their first three tokens follow
    the target's exact joint distribution (chi-square), as on the CPU."""
    from ddtree.engine.batch import BatchOptions
    from ddtree.fast.batch_round import DeviceRound
    from distributions import exact_joint, fit_p_value
    from tiny import make_draft, make_target

    make_target(tmp_path / "t", vocab=12, seed=11)
    make_draft(tmp_path / "d", vocab=12, seed=12, block_size=4)
    joint = exact_joint(Engine.from_pretrained(tmp_path / "t", tmp_path / "d", device="cpu").target.model,
                        [1, 2, 3], 12, 3, **kw)
    fast = Engine.from_pretrained(tmp_path / "t", tmp_path / "d", device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256)
    batch = fast.batch(BatchOptions(max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_tokens=8192))
    assert batch.backends[0].device_round._rounds  # captured at start-up
    batch.backends[0].choice = None  # every round drafts (no plain round on the host): this test is of the device's
    rounds = []
    replay = DeviceRound.replay
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DeviceRound, "replay",
                      lambda self, starts, *more: rounds.append(len(starts)) or replay(self, starts, *more))
        params = SamplingParams(max_new_tokens=3, ignore_eos=True, **kw)
        seqs = [batch.add([1, 2, 3], params, method="ddtree", budget=6) for _ in range(1000)]
        while batch.has_work():
            batch.step()
    counts: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        key = tuple(seq.generation.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert sum(rounds) >= 1000
    assert fit_p_value(counts, joint) > 1e-4


def batch_matches_ar(batch, reference: Engine, prompts: list[list[int]], dtype: str,
                     float32: Engine | None = None) -> None:
    """Every prompt under every method in one batch, all on the paged path: each request's tokens are the
    reference's own greedy `ar` tokens (float32: exactly; bf16: parting only at a tie within rounding noise,
    `within_noise`)."""
    runs = [("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64)]
    requests = [(p, r) for p in prompts for r in runs]
    seqs = [batch.add(p, GREEDY, method=m, budget=b) for p, (m, b) in requests]
    while batch.has_work():
        batch.step()
    assert all(seq.backend is batch.backends[0] for seq in seqs)
    tokens_match_ar(reference, requests, seqs, dtype, float32)


def tokens_match_ar(reference: Engine, requests: list[tuple], seqs: list, dtype: str,
                    float32: Engine | None = None) -> None:
    """Each (prompt, (method, budget)) request's tokens are the reference's own greedy `ar` tokens (float32:
    exactly; bf16: parting only at a tie within rounding noise, `within_noise`)."""
    for (prompt, (method, budget)), seq in zip(requests, seqs, strict=True):
        want = reference.generate(prompt, GREEDY, method="ar").token_ids
        got = seq.generation.token_ids
        if got != want:
            parted = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                          min(len(want), len(got)))
            where = (method, budget, len(prompt), f"parts at token {parted} of {len(want)}/{len(got)}")
            assert dtype != "float32", where
            assert within_noise(reference, prompt, want, got, float32), where


@gpu
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_hybrid_rounds_replay_as_graphs_and_give_each_requests_tokens(tmp_path, dtype, arch):
    """A Qwen3.5 and a Qwen3-Next hybrid on the paged path: every verify's Gated DeltaNet layers in the varlen
    kernels for all sequences, replayed from the bucketed CUDA graphs; prompts through the per-sequence pieces
    (one longer than a piece); each request gets the tokens it gets alone (float32: exactly; bf16: up to the
    reference's near-ties), and every block and state slot comes back."""
    from ddtree.core.blocks import BlockManager
    from ddtree.engine.batch import BatchEngine
    from ddtree.engine.serial import SerialBackend
    from ddtree.fast.batch import PagedBackend
    from tiny import make_draft, make_hybrid_target

    make_draft(tmp_path / "draft", taps=[1, 2])
    make_hybrid_target(tmp_path / "hybrid", arch, seed=0)
    fast = Engine.from_pretrained(tmp_path / "hybrid", tmp_path / "draft", device="cuda", dtype=dtype)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    pool = BlockManager(512, 16)
    paged = PagedBackend(fast.target, fast.draft, fast.draft_head, pool, max_seqs=8, max_rows=256)
    with torch.inference_mode():
        paged.capture_all()
    assert paged.static and paged.hybrid.varlen and paged.captured
    batch = BatchEngine(fast, [paged, SerialBackend(fast.reference)], max_num_seqs=8, max_num_batched_tokens=256,
                        blocks=pool)
    float32 = Engine.from_pretrained(tmp_path / "hybrid", tmp_path / "draft", device="cpu", dtype="float32")
    batch_matches_ar(batch, reference, [[1, 2, 3, 4, 5], [(7 * i) % 90 + 3 for i in range(300)],
                                        list(range(30, 60))], dtype, float32)
    assert pool.free_blocks == pool.num_blocks and not paged.hybrid.pool.slots


@gpu
def test_a_pair_the_paged_path_cannot_batch_runs_one_at_a_time_on_the_fast_path(fast_ckpt, monkeypatch):
    """A pair the paged path declines (today: one whose paged kernels do not build on this GPU) is decoded one
    request at a time on the single-sequence fast path (graphs and all), not many at a time eagerly."""
    from ddtree.engine.batch import BatchOptions
    from ddtree.fast.batch import PagedBackend

    monkeypatch.setattr(PagedBackend, "declines", staticmethod(lambda target, draft: "declined for the test"))
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", fast=True)
    batch = fast.batch(BatchOptions(max_num_seqs=8))
    assert batch.max_num_seqs == 1 and batch.backends[0].name == "fast"
    seq = batch.add([1, 2, 3, 4, 5], GREEDY, method="ddtree", budget=8)
    while batch.has_work():
        batch.step()
    assert seq.backend is batch.backends[0]
