"""Hybrid targets (Gated DeltaNet + gated attention) on the fast path: the reference's tokens, rounds and logits."""

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.core.tree import build_tree
from ddtree.engine import Engine
from ddtree.fast import hybrid as fast_hybrid
from ddtree.kernels.tree import ancestors
from test_agreement import prompt_logprobs_agree, rounds_agree
from tiny import make_dflash2_draft, make_draft, make_hybrid_target, path_tokens

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [17], list(range(60, 90))]
RUNS = [("ar", None), ("dflash", None), ("ddtree", 1), ("ddtree", 5), ("ddtree", 32), ("ddtree", 128)]


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """(reference engine, fast engine) over one tiny Qwen3.5 hybrid (3 Gated DeltaNet + 1 attention layer)."""
    root = tmp_path_factory.mktemp("hybrid_fast")
    make_draft(root / "draft", taps=[1, 2])
    make_hybrid_target(root / "qwen3_5", "qwen3_5", seed=0)
    make_hybrid_target(root / "qwen3_5_moe", "qwen3_5_moe", seed=1)
    make_hybrid_target(root / "qwen3_next", "qwen3_next", seed=2)
    fast = Engine.from_pretrained(root / "qwen3_5", root / "draft", device="cpu", fast=True, fast_capacity=512)
    return Engine(fast.target, fast.draft, fast.tokenizer), fast, root


def test_a_dense_hybrid_takes_the_hybrid_fast_path(hybrid_pair):
    _, fast, _ = hybrid_pair
    assert type(fast.fast).__name__ == "HybridFastPath" and fast.fast_unsupported is None


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_moe_hybrids_take_the_fast_path_with_the_reference_tokens(hybrid_pair, arch):
    """Qwen3.5-MoE (M-RoPE) and Qwen3-Next (plain RoPE, its own projection layout): routed experts plus a
    gated shared expert in every layer."""
    from ddtree.kernels.moe import Experts

    _, _, root = hybrid_pair
    fast = Engine.from_pretrained(root / arch, root / "draft", device="cpu", fast=True, fast_capacity=512)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert type(fast.fast).__name__ == "HybridFastPath"
    assert all(isinstance(mlp, Experts) and mlp.shared is not None for mlp in fast.fast.hybrid.mlps)
    for prompt in PROMPTS:
        for method, budget in RUNS:
            rounds_agree(fast, reference, prompt, GREEDY, method, budget)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_norm_of_a_hybrid_runs_as_its_own_function_with_the_module_output(hybrid_pair, arch, dtype):
    """The fast path runs a hybrid's norms (layer, final, q/k and gated norms) as functions of its own, compiled
    on CUDA into one kernel each: every one of the model's norm types has one, and it gives the module's own
    output bit for bit."""
    import copy

    _, _, root = hybrid_pair
    fast = Engine.from_pretrained(root / arch, root / "draft", device="cpu", fast=True, fast_capacity=64)
    norms = {type(m).__name__: m for m in fast.fast.model.modules() if "RMSNorm" in type(m).__name__}
    assert set(norms) <= set(fast.fast.hybrid.norm_ops) and any(name.endswith("Gated") for name in norms)
    gen = torch.Generator().manual_seed(0)
    for name, module in norms.items():
        module = copy.deepcopy(module).to(dtype)
        module.weight.data = torch.randn(module.weight.shape, generator=gen).to(dtype)
        x = (3 * torch.randn(7, module.weight.numel(), generator=gen)).to(dtype)
        gate = (torch.randn(x.shape, generator=gen).to(dtype),) if name.endswith("Gated") else ()
        assert torch.equal(fast.fast.hybrid.norm(module, x, *gate), module(x, *gate)), name


def test_same_tokens_and_same_acceptance_as_the_reference(hybrid_pair):
    reference, fast, _ = hybrid_pair
    for prompt in PROMPTS:
        ar = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in RUNS:
            assert rounds_agree(fast, reference, prompt, GREEDY, method, budget) == ar, (method, budget)


def test_a_dflash2_drafter_over_a_hybrid_gives_the_reference_rounds(hybrid_pair, tmp_path):
    """Qwen3.6-style: a hybrid target with a DFlash2 drafter (its selector's chain and tree) on the fast path."""
    reference, _, root = hybrid_pair
    fast = Engine.from_pretrained(root / "qwen3_5", make_dflash2_draft(tmp_path / "d2", taps=[1, 2]), device="cpu",
                                  fast=True, fast_capacity=512)
    ref = Engine(fast.target, fast.draft, fast.tokenizer)
    for prompt in PROMPTS[:2]:
        ar = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 5), ("ddtree", 32)):
            assert rounds_agree(fast, ref, prompt, GREEDY, method, budget) == ar, (method, budget)


def test_prompts_longer_than_a_chunk_run_chunk_by_chunk_with_the_same_tokens(hybrid_pair, monkeypatch):
    reference, fast, _ = hybrid_pair
    monkeypatch.setattr(fast_hybrid, "PROMPT_CHUNK", 7)  # 30 tokens: four chunks, the last one short
    prompt = list(range(60, 90))
    for method, budget in (("ar", None), ("ddtree", 16)):
        assert fast.generate(prompt, GREEDY, method=method, budget=budget).token_ids == \
            reference.generate(prompt, GREEDY, method=method, budget=budget).token_ids
    scored = SamplingParams(max_new_tokens=8, prompt_logprobs=2, ignore_eos=True)  # every chunk's rows
    gen = fast.stream(prompt, scored, method="ddtree", budget=16)
    got = next(gen).prompt_logprobs
    want = next(reference.stream(prompt, scored, method="ddtree", budget=16)).prompt_logprobs
    assert gen.backend.name == "fast"
    prompt_logprobs_agree(got, want, tolerance=1e-4)  # the closed form sums in another order


def test_every_tree_node_gets_the_logits_of_its_path_run_alone(hybrid_pair):
    reference, fast, _ = hybrid_pair
    path = fast.fast
    torch.manual_seed(0)
    prefix = torch.randint(0, 90, (9,)).tolist()
    tree = build_tree(torch.randn(7, 96) * 3, 24)
    with torch.inference_mode():
        path.prefill(torch.tensor(prefix), with_draft=False)
        parents = torch.tensor(tree.parents).clamp(min=0)  # the root as its own parent, as the tree kernel has it
        depths = torch.tensor([0, *tree.depths])
        visible = ancestors(parents, int(depths.max()))
        ids = torch.tensor([13, *tree.tokens])
        logits, _, _ = path.forward(ids, path.start + depths, visible)
    target = reference.target
    for node in range(tree.size + 1):
        alone = [*prefix, 13, *path_tokens(tree, node)]
        want, _ = target.forward(torch.tensor(alone), torch.arange(len(alone)), target.new_cache())
        torch.testing.assert_close(logits[node], want[-1], atol=2e-4, rtol=2e-4)


def test_a_hybrids_norms_compile_once_for_every_row_count():
    """Compiled (as on CUDA), a hybrid's norm makes one graph for every row count a batch pads to, single rows
    included: one per count would reach dynamo's recompile limit and fall back to eager mid-serve."""
    from ddtree.fast.layers import _compiled

    counters = torch._dynamo.utils.counters["stats"]
    gen = torch.Generator().manual_seed(0)
    for fn, gated in ((fast_hybrid.offset_rms_norm, False), (fast_hybrid.gated_rms_norm, True)):
        compiled, before = _compiled(fn, any_rows=True), counters["unique_graphs"]
        for rows in (1, 2, 8, 33, 256):
            x, weight = torch.randn(rows, 32, generator=gen), torch.randn(32, generator=gen)
            gate = (torch.randn(rows, 32, generator=gen),) if gated else ()
            torch.testing.assert_close(compiled(x, *gate, weight, 1e-6), fn(x, *gate, weight, 1e-6))
        assert counters["unique_graphs"] - before <= 1, fn.__name__
