"""Qwen3-MoE targets on the fast path: the experts in fixed shapes (ddtree/kernels/moe.py) against transformers'
sparse block, and whole generations against the reference path."""

import os

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.kernels import jit, moe
from test_agreement import prompt_logprobs_agree, rounds_agree
from tiny import make_draft, make_target


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    make_target(root / "moe", "qwen3_moe", seed=4)
    make_draft(root / "draft")
    return root


@pytest.fixture(params=["grouped GEMM", "loop over experts", "Triton kernels"])
def grouping(request, monkeypatch):
    """Every way the experts run: torch's grouped GEMM, the fixed loop that stands in where it is missing, and
    the Triton kernels (interpreted on a CPU machine; tests/kernels/test_experts.py runs them compiled)."""
    if request.param == "loop over experts":
        monkeypatch.setattr(moe, "grouped_works", lambda device, dtype: False)
    if request.param == "Triton kernels":
        if os.environ.get("TRITON_INTERPRET") != "1" or moe.triton is None:
            pytest.skip("the interpreted kernels run on CPU-only machines (the GPU compiles them)")
        monkeypatch.setattr(jit, "INTERPRETED_ON_CPU", True)
    return request.param


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_equal_the_sparse_block_they_replace(moe_ckpt, grouping, rows, dtype):
    """Float32: the block's output up to rounding (the same picks, the adds in the same order, the products
    blocked otherwise: bit for bit at a few rows); bf16 up to the products' rounding. One row leaves most
    experts without a token."""
    from transformers import AutoModelForCausalLM

    if grouping == "Triton kernels" and dtype == torch.bfloat16:
        pytest.skip("Triton 3.9's interpreter garbles bf16 products (tests/kernels/test_experts.py runs them on a GPU)")
    model = AutoModelForCausalLM.from_pretrained(moe_ckpt / "moe", dtype=dtype)
    mlp = model.model.layers[0].mlp
    h = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows)).to(dtype)
    with torch.no_grad():
        want = mlp(h[None])[0]
        got = moe.Experts.of(mlp)(h)
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), (got - want).abs().max()
    else:
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("grouping", ["grouped GEMM", "loop over experts"], indirect=True)
def test_a_qwen3_moe_target_decodes_on_the_fast_path_with_the_reference_tokens(moe_ckpt, grouping):
    """(Whole generations on the interpreted kernels, these included, are tests/fast/test_interpreted.py's.)"""
    fast = Engine.from_pretrained(moe_ckpt / "moe", moe_ckpt / "draft", device="cpu", fast=True, fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert fast.fast_unsupported is None and any(layer.experts for layer in fast.fast.layers)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            rounds_agree(fast, reference, prompt, params, method, budget)


def test_moe_logprobs_on_the_fast_path_equal_the_reference_paths(moe_ckpt):
    """Greedy with logprobs and prompt logprobs: the log-probabilities through the experts, not only the picks."""
    fast = Engine.from_pretrained(moe_ckpt / "moe", moe_ckpt / "draft", device="cpu", fast=True, fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    params = SamplingParams(max_new_tokens=24, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    prompt = list(range(30, 50))
    rounds = list(gen := fast.stream(prompt, params, method="ddtree", budget=16))
    ref_rounds = list(ref := reference.stream(prompt, params, method="ddtree", budget=16))
    assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids
    got = [entry.logprob for r in rounds for entry in r.logprobs]
    assert got == pytest.approx([entry.logprob for r in ref_rounds for entry in r.logprobs], abs=1e-5)
    prompt_logprobs_agree(rounds[0].prompt_logprobs, ref_rounds[0].prompt_logprobs)
