"""fp8 drafts (ddtree.quantize): the drafter's projections in e4m3, and the output still the target's own."""

import copy
import json

import pytest
import torch
from ddtree.cli import main
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.kernels.fp8 import FP8_MAX, Fp8Weight, quantize_rows, quantize_weight, reference_linear
from ddtree.models import quantize
from ddtree.models.draft_vocab import DraftHead
from ddtree.models.quantize import Fp8Linear, quantize_module
from tiny import make_dflash2_draft, make_hybrid_target

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(60, 90))]
E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: a normal value rounds within half a step of 2^-3 (relative)


def test_each_row_is_scaled_to_e4m3s_range_and_rounds_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 200, generator=gen) * torch.logspace(-3, 3, 6)[:, None]  # rows six decades apart
    x[2] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    back = q.float() * scale[:, None]
    live = [0, 1, 3, 4, 5]
    assert torch.equal(q.float().abs().amax(dim=1)[live], torch.full((5,), FP8_MAX))  # the largest maps to 448
    normal = x.abs() >= scale[:, None] * 2.0**-6  # e4m3's smallest normal, in the row's scale
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= E4M3_STEP / 2 + 1e-6
    assert not back[2].any() and torch.isfinite(back).all()  # an all-zero row stays zero, with no NaN
    w = quantize_weight(x)  # weights: the same rule per output row
    assert torch.equal(w.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(w.scale, scale)


def test_the_fp8_product_sums_exact_products_then_scales_and_stays_close_to_the_unquantized_one():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 256, generator=gen), torch.randn(40, 256, generator=gen)
    weight = quantize_weight(w)
    got = reference_linear(x, weight)
    xq, xs = quantize_rows(x)
    dequantized = (xq.double() * xs.double()[:, None]) @ (weight.data.double() * weight.scale.double()[:, None]).T
    assert torch.allclose(got.double(), dequantized, rtol=1e-5, atol=1e-5)
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.06  # random data: e4m3's rounding, ~4 %


def test_an_fp8_linear_keeps_only_fp8_values_and_scales_and_takes_any_leading_dims():
    linear = torch.nn.Linear(64, 24, bias=False)
    module = Fp8Linear(linear)
    assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale.shape == (24,)
    assert not list(module.parameters())
    x = torch.randn(2, 3, 64)
    assert torch.equal(module(x), reference_linear(x.view(6, 64), module.fp8).view(2, 3, 24))
    with pytest.raises(DDTreeError, match="bias-free"):
        Fp8Linear(torch.nn.Linear(64, 24, bias=True))


def test_quantizing_a_draft_replaces_every_projection_once_and_keeps_its_norms(ckpt):
    engine = Engine.from_pretrained(ckpt / "qwen3", ckpt / "draft", device="cpu", draft_quantization="fp8")
    draft = engine.draft
    projections = [m for m in draft.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 1 + 7 * draft.config.num_layers  # fc, and q k v o gate up down per layer
    assert not any(type(m) is torch.nn.Linear for m in draft.modules())
    assert all(p.dtype == torch.float32 for p in draft.parameters())  # the norms, as loaded
    assert quantize_module(draft) == 0
    assert isinstance(engine.draft_head.weight, Fp8Weight)  # the head's rows too (a copy: the target keeps its own)
    assert engine.target.lm_head.weight.dtype == torch.float32


def test_a_draft_quantized_after_a_fast_path_fused_it_drafts_every_projection_in_fp8(ckpt):
    """A fast path keeps its fused projections on the draft module; quantizing that module later (a copy of it,
    as benchmarks/ab_draft.py makes) must not leave the fused ones in the old format."""
    plain = Engine.from_pretrained(ckpt / "qwen3", ckpt / "draft", device="cpu", fast=True)
    fp8 = Engine(plain.target, copy.deepcopy(plain.draft), fast=True, draft_quantization="fp8")
    fused = fp8.fast.fused_draft
    projections = [fused.fc, fused.context_kv, *(p for layer in fused.layers
                                                 for p in (layer.q, layer.kv, layer.o, layer.gate_up, layer.down))]
    assert all(isinstance(p.weight, Fp8Weight) for p in projections)
    assert not isinstance(plain.fast.fused_draft.layers[0].gate_up.weight, Fp8Weight)
    prompt = PROMPTS[1]
    assert fp8.generate(prompt, GREEDY).token_ids == plain.generate(prompt, GREEDY, method="ar").token_ids


@pytest.mark.parametrize("arch", ["qwen3", "llama", "moe", "hybrid"])
def test_greedy_output_with_an_fp8_draft_is_the_targets_own_on_both_paths(ckpt, arch, tmp_path):
    target = make_hybrid_target(tmp_path / "hybrid", "qwen3_5") if arch == "hybrid" else ckpt / arch
    quantized = Engine.from_pretrained(target, ckpt / "draft", device="cpu", draft_quantization="fp8")
    fast = Engine.from_pretrained(target, ckpt / "draft", device="cpu", fast=True, draft_quantization="fp8")
    assert fast.fast is not None
    for prompt in PROMPTS:
        want = quantized.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 8), ("ddtree", 40)):
            ref = list(gen := quantized.stream(prompt, GREEDY, method=method, budget=budget))
            got = list(fast_gen := fast.stream(prompt, GREEDY, method=method, budget=budget))
            assert gen.token_ids == want and fast_gen.token_ids == want, (method, budget)
            assert fast_gen.backend.name == "fast"
            # both paths draft with the same fp8 function: the same trees, the same acceptance round for round
            assert [r.accepted for r in got] == [r.accepted for r in ref]


def test_a_quantized_dflash2_draft_gives_the_targets_tokens_on_both_paths(ckpt, tmp_path):
    """DFlash2's convolutions' and selector's projections in fp8 too (its codebooks are lookups, kept as they are):
    the same trees on both paths, and the target's tokens."""
    draft = make_dflash2_draft(tmp_path / "d2")
    quantized = Engine.from_pretrained(ckpt / "qwen3", draft, device="cpu", draft_quantization="fp8")
    fast = Engine.from_pretrained(ckpt / "qwen3", draft, device="cpu", fast=True, draft_quantization="fp8")
    layers = quantized.draft.config.num_layers
    assert sum(isinstance(m, Fp8Linear) for m in quantized.draft.modules()) == 1 + 9 * layers + 1
    assert isinstance(fast.fast.fused_draft.layers[0].attention_taps.weight, Fp8Weight)
    prompt = PROMPTS[1]
    want = quantized.generate(prompt, GREEDY, method="ar").token_ids
    for method, budget in (("dflash", None), ("ddtree", 24)):
        ref = list(gen := quantized.stream(prompt, GREEDY, method=method, budget=budget))
        got = list(fast_gen := fast.stream(prompt, GREEDY, method=method, budget=budget))
        assert gen.token_ids == fast_gen.token_ids == want and fast_gen.backend.name == "fast", method
        assert [r.accepted for r in got] == [r.accepted for r in ref], method


def test_an_fp8_draft_still_drafts_what_the_bf16_draft_drafts_on_the_demo_pair():
    """The trained demo pair: fp8 keeps the drafter's acceptance (τ) within a few percent."""
    plain, fp8 = (Engine.from_pretrained(device="cpu", draft_quantization=q) for q in (None, "fp8"))
    prompt = plain.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = ")
    params = SamplingParams(max_new_tokens=96, ignore_eos=True)
    want, got = (e.generate(prompt, params, method="ddtree", budget=32) for e in (plain, fp8))
    assert got.token_ids == want.token_ids == plain.generate(prompt, params, method="ar").token_ids
    assert got.stats.acceptance_length >= 0.9 * want.stats.acceptance_length > 2.0


def test_a_draft_vocabulary_scores_with_fp8_copies_of_its_rows():
    head = torch.nn.Linear(64, 10, bias=False)
    sub = DraftHead(head, [7, 2, 5], quantization="fp8")
    assert sub.size == 3 and sub.token_ids.tolist() == [2, 5, 7] and isinstance(sub.weight, Fp8Weight)
    hidden = torch.randn(3, 64)
    assert torch.equal(sub(hidden), reference_linear(hidden, quantize_weight(head.weight[[2, 5, 7]])))


def test_fp8_drafts_fail_clearly_where_they_cannot_run(ckpt, monkeypatch):
    with pytest.raises(DDTreeError, match="must be one of none, fp8, got 'int4'"):
        Engine.from_pretrained(ckpt / "qwen3", ckpt / "draft", device="cpu", draft_quantization="int4")
    with pytest.raises(DDTreeError, match="needs a DFlash draft"):
        Engine.from_pretrained(ckpt / "qwen3", None, device="cpu", method="ar", draft_quantization="fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(DDTreeError, match=r"compute capability 8\.9 or later.*A100-SXM4-80GB is 8\.0"):
        quantize.check_device(torch.device("cuda", 0))
    assert Engine.from_pretrained(ckpt / "qwen3", ckpt / "draft", device="cpu",
                                  draft_quantization="none").draft_quantization is None


def test_generate_with_draft_quantization_prints_the_targets_tokens(capsys):
    args = ["generate", "--prompt-ids", "1,2,3,4,5,6", "--device", "cpu", "--max-new-tokens", "20", "--json"]
    assert main([*args, "--method", "ar"]) == 0
    want = capsys.readouterr().out
    assert main([*args, "--draft-quantization", "fp8"]) == 0
    got = capsys.readouterr().out
    assert json.loads(got)["token_ids"] == json.loads(want)["token_ids"]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--draft-quantization", "int8"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "invalid choice: 'int8'" in err and "Traceback" not in err
