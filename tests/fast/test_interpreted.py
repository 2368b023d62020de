"""Whole generations with every fast-path kernel in place, run by Triton's interpreter on the CPU, against
the reference path."""


import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.kernels import jit
from marks import interpreted
from test_agreement import prompt_logprobs_agree
from tiny import make_draft, make_hybrid_target, make_target

# each target's methods; together they put every kernel in place, each dense-attention target every
# attention form: one loop (AR rows), two loops in short tiles (up to 128 grouped rows) and in tall ones (65 nodes)
GENERATIONS = {"qwen3": [("ar", None), ("ddtree", 24), ("ddtree", 64)],
               "hybrid": [("ar", None), ("ddtree", 24), ("ddtree", 64)], "hybrid_moe": [("ar", None)],
               "moe": [("ar", None), ("ddtree", 24)]}


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("name", list(GENERATIONS))
def test_generations_on_the_interpreted_kernels_equal_the_reference_path(name, kernels_on_cpu, tmp_path, monkeypatch):
    """Every kernel in place (GEMVs for AR steps, the few-row GEMM, the heads step, tree attention, the
    vocabulary top-k, the tree program, the MoE experts, a Gated DeltaNet layer's AR step and tree): the
    reference's tokens, acceptance, logprobs and prompt logprobs, for a dense target, a dense and an MoE hybrid,
    and a mixture-of-experts one. One test per target, so that each stays well inside the per-test timeout on
    a slow machine (interpreted, the four took 20, 32, 4 and 10 s on one 2-core machine, beside another test). The
    methods are the fewest that run every kernel form: dflash and ddtree 5 ran no kernel that ddtree 24 does not."""
    from ddtree.fast import hybrid as fast_hybrid
    from ddtree.kernels import attention, gdn, gemm
    from ddtree.kernels.heads import attention_heads as heads_kernel

    monkeypatch.setattr(fast_hybrid, "PROMPT_CHUNK", 7)  # a hybrid's 10-token prompt: chunks of 7 and 3 nodes
    # 2 target layers and 1 draft layer (interpreted, every launch is slow): a hybrid's are a Gated DeltaNet layer
    # and a full-attention one (every tree node runs a program per head in each Gated DeltaNet layer)
    draft = make_draft(tmp_path / "draft", target_layers=2, layers=1, taps=[0, 1])
    if name in ("qwen3", "moe"):
        target = make_target(tmp_path / name, "qwen3" if name == "qwen3" else "qwen3_moe", seed=4, layers=2)
    else:
        target = make_hybrid_target(tmp_path / name, "qwen3_5" if name == "hybrid" else "qwen3_5_moe",
                                    seed=0 if name == "hybrid" else 1, layers=2)
    # 4 tokens: 3 rounds a tree, among them one that accepts a draft token and one after it, in every target
    params = SamplingParams(max_new_tokens=4, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    launches, gdn_steps, attention_forms = [], set(), set()
    real, real_row, real_tree = gemm.skinny_linear, gdn.row_step, gdn.tree_step
    real_config = attention.launch_config

    def launch_config(*args: int) -> dict[str, int]:
        cfg = real_config(*args)
        attention_forms.add((cfg["block_m"], cfg["two_loops"]))
        return cfg

    monkeypatch.setattr(attention, "launch_config", launch_config)
    monkeypatch.setattr(gdn, "row_step", lambda *a: gdn_steps.add("row") or real_row(*a))
    monkeypatch.setattr(gdn, "tree_step", lambda *a: gdn_steps.add("tree") or real_tree(*a))
    counting = lambda *a, **kw: launches.append(1) or real(*a, **kw)  # noqa: E731
    fast = Engine.from_pretrained(target, draft, device="cpu", fast=True, fast_capacity=128)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    if name == "qwen3":  # (a hybrid's forward has neither)
        assert fast.fast.row_gemv and fast.fast.ops.attention_heads is heads_kernel
    if name == "moe":  # its experts through the Triton kernels, its AR steps through the GEMV layers
        assert fast.fast.row_gemv
        experts = fast.fast.layers[0].experts
        assert experts.kernels_take(torch.zeros(25, experts.router.shape[1]))
    for method, budget in GENERATIONS[name]:
        monkeypatch.setattr(gemm, "skinny_linear", counting)  # counted on the fast path only
        gen = fast.stream(list(range(30, 40)), params, method=method, budget=budget)
        rounds = list(gen)
        monkeypatch.setattr(gemm, "skinny_linear", real)
        ref = reference.stream(list(range(30, 40)), params, method=method, budget=budget)
        ref_rounds = list(ref)
        assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids, (method, budget)
        assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds]
        got = [lp.logprob for r in rounds for lp in r.logprobs]
        assert got == pytest.approx([lp.logprob for r in ref_rounds for lp in r.logprobs], abs=1e-4)
        prompt_logprobs_agree(rounds[0].prompt_logprobs, ref_rounds[0].prompt_logprobs, tolerance=1e-4)
    if name in ("qwen3", "moe"):
        assert launches  # the few-row GEMM ran (draft blocks, small trees)
    if name in ("qwen3", "hybrid"):
        assert {(16, 0), (16, 2), (64, 2)} <= attention_forms  # an AR row, a draft block, a 65-node tree
    if name.startswith("hybrid"):  # AR steps through the row kernel, trees and prompts through the tree kernel
        assert gdn_steps == {"row", "tree"}


@interpreted
@pytest.mark.slow
def test_an_fp8_draft_on_the_interpreted_kernels_gives_the_targets_tokens(kernels_on_cpu, tmp_path, monkeypatch):
    """A quantized drafter with every fp8 kernel in place (the row quantization, alone and folded into the norms
    and SiLU · up, and the GEMM, for the block pass, the commit's context projections and the head): the output
    is the reference path's `ar` output."""
    from ddtree.kernels import gemm, rows

    launches, folded = [], []
    real = gemm.skinny_fp8
    monkeypatch.setattr(gemm, "skinny_fp8", lambda *a: launches.append(a[2].shape) or real(*a))
    for name in ("rms_norm_fp8", "silu_mul_fp8"):
        kernel = getattr(rows, name)
        monkeypatch.setattr(rows, name, lambda *a, kernel=kernel, name=name: folded.append(name) or kernel(*a))
    draft = make_draft(tmp_path / "draft", target_layers=2, layers=1, taps=[0, 1])
    target = make_target(tmp_path / "qwen3", "qwen3", seed=4, layers=2)
    fast = Engine.from_pretrained(target, draft, device="cpu", fast=True, fast_capacity=128,
                                  draft_quantization="fp8")
    reference = Engine.from_pretrained(target, draft, device="cpu")
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)  # (every kernel runs in each round)
    want = reference.generate(list(range(30, 40)), params, method="ar").token_ids
    gen = fast.stream(list(range(30, 40)), params, method="ddtree", budget=16)
    rounds = list(gen)
    assert gen.backend.name == "fast" and gen.token_ids == want and len(rounds) > 1
    heads = fast.draft_head.size
    assert {(heads, 64), (2 * 16 * 2, 64), (64, 128)} <= set(launches)  # the head, the context k/v, fc
    assert set(folded) == {"rms_norm_fp8", "silu_mul_fp8"}


@interpreted
@pytest.mark.slow
def test_a_dflash2_draft_with_sinks_on_the_interpreted_kernels_gives_the_reference_rounds(kernels_on_cpu, tmp_path):
    """Every drafter feature on the device kernels at once (a causal windowed layer with sinks, the convolutions,
    the selector's transitions, the selector tree and chain programs, sink attention): the reference path's
    tokens and acceptance, round for round."""
    from tiny import make_dflash2_draft

    draft = make_dflash2_draft(tmp_path / "draft", target_layers=2, layers=1, taps=[0, 1], is_causal=None,
                               sliding_window=4, sinks="sinks")
    target = make_target(tmp_path / "qwen3", "qwen3", seed=4, layers=2)
    fast = Engine.from_pretrained(target, draft, device="cpu", fast=True, fast_capacity=128)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert fast.draft.config.layer_causal == (True,) and fast.fast.fused_draft.sinks[0] is not None
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for method, budget in (("dflash", None), ("ddtree", 24)):
        gen = fast.stream(list(range(30, 40)), params, method=method, budget=budget)
        rounds = list(gen)
        ref = reference.stream(list(range(30, 40)), params, method=method, budget=budget)
        ref_rounds = list(ref)
        assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids, method
        assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds], method
    assert not [key for key in jit._DECLINED if key[0].startswith("selector")]  # its programs ran, interpreted
