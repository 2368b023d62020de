"""FP8 targets (ddtree/models/fp8_target.py): Qwen's published block-scaled FP8 checkpoints (written here from tiny
random models) and bf16 targets quantized on load; `ddtree` keeps the FP8 target's own greedy `ar` output."""

import inspect
import json
import shutil

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.kernels.fp8 import Fp8Weight, dequantize
from ddtree.models import quantize
from ddtree.models.fp8_target import Fp8Experts, stored_bytes
from ddtree.models.quantize import Fp8Linear
from safetensors import safe_open
from tiny import FP8_CONFIG, make_draft, make_fp8_checkpoint, make_hybrid_target, make_target

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(60, 80))]
HIDDEN = 128  # K of the projections a multiple of the 128-wide scale blocks, as in every Qwen model


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    make_draft(root / "draft", hidden=HIDDEN, taps=[1, 2])
    make_target(root / "qwen3", "qwen3", hidden=HIDDEN, head_dim=32)
    make_target(root / "moe", "qwen3_moe", seed=4, hidden=HIDDEN, head_dim=32)
    make_hybrid_target(root / "qwen3_5", "qwen3_5", hidden=HIDDEN)
    make_hybrid_target(root / "qwen3_5_moe", "qwen3_5_moe", hidden=HIDDEN, seed=1)
    for name in ("qwen3", "moe", "qwen3_5", "qwen3_5_moe"):
        make_fp8_checkpoint(root / name, root / f"{name}-fp8")
    return root


def agree(engine: Engine, methods=(("dflash", None), ("ddtree", 1), ("ddtree", 16))) -> None:
    """Greedy dflash and ddtree emit the target's own greedy `ar` tokens."""
    for prompt in PROMPTS:
        ar = engine.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in methods:
            assert engine.generate(prompt, GREEDY, method=method, budget=budget).token_ids == ar, (method, budget)


def test_a_published_fp8_checkpoint_keeps_its_values_and_block_scales(fp8_ckpt):
    engine = Engine.from_pretrained(fp8_ckpt / "qwen3-fp8", fp8_ckpt / "draft", device="cpu")
    model = engine.target.model
    assert engine.target.quantization == "fp8 (128 x 128 block scales, from the checkpoint)"
    projections = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 7 * 4 and all(m.block == (128, 128) for m in projections)
    assert type(model.lm_head) is torch.nn.Linear and not isinstance(model.model.embed_tokens, Fp8Linear)
    q = model.model.layers[1].self_attn.q_proj
    with safe_open(fp8_ckpt / "qwen3-fp8" / "model.safetensors", framework="pt") as f:
        data = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        scale = f.get_tensor("model.layers.1.self_attn.q_proj.weight_scale_inv")
    assert torch.equal(q.weight.view(torch.uint8), data.view(torch.uint8)) and torch.equal(q.weight_scale, scale)
    plain = Engine.from_pretrained(fp8_ckpt / "qwen3", device="cpu", method="ar").target.model
    original = plain.model.layers[1].self_attn.q_proj.weight
    assert torch.allclose(dequantize(q.fp8), original, rtol=0.07, atol=1e-3)  # e4m3's rounding, per block
    assert stored_bytes(model) < stored_bytes(plain)


@pytest.mark.parametrize("name", ["qwen3-fp8", "qwen3_5-fp8", "moe-fp8"])
def test_greedy_ddtree_equals_the_fp8_targets_own_ar_on_the_reference_path(fp8_ckpt, name):
    """Dense Qwen3, a Qwen3.5 hybrid (multimodal layout), Qwen3-MoE (per-expert fp8 weights, as Qwen publishes)."""
    engine = Engine.from_pretrained(fp8_ckpt / name, fp8_ckpt / "draft", device="cpu")
    if name == "moe-fp8":
        assert all(isinstance(layer.mlp.experts, Fp8Experts) for layer in engine.target.layers)
    agree(engine)


@pytest.mark.parametrize("name", ["qwen3-fp8", "qwen3_5-fp8", "moe-fp8"])
def test_greedy_ddtree_equals_the_fp8_targets_own_ar_on_the_fast_path(fp8_ckpt, name):
    """Qwen3-MoE's fp8 experts too (here in their PyTorch steps: fp8_linear per expert; the kernels are
    test_the_fast_paths_fp8_expert_kernels_give_the_reference_tokens')."""
    fast = Engine.from_pretrained(fp8_ckpt / name, fp8_ckpt / "draft", device="cpu", fast=True, fast_capacity=256)
    assert fast.fast is not None, fast.fast_unsupported
    if name == "moe-fp8":
        assert all(layer.experts.fp8 and layer.experts.down.block == (128, 128) for layer in fast.fast.layers)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    agree(fast, (("ar", None), ("dflash", None), ("ddtree", 16)))
    for prompt in PROMPTS:  # and the reference path's tokens: the same fp8 products
        assert (fast.generate(prompt, GREEDY, method="ddtree", budget=16).token_ids
                == reference.generate(prompt, GREEDY, method="ar").token_ids)


@pytest.mark.parametrize("name", ["qwen3-fp8", "moe-fp8"])
def test_an_fp8_target_batches_on_the_paged_fast_path(fp8_ckpt, name):
    """Requests of different lengths and methods in one batch on the FP8 checkpoint: each decodes what the FP8
    target decodes alone, through the same fp8 projections (fast/layers.py) and experts as the single-sequence
    path."""
    from ddtree.core.blocks import BlockManager
    from ddtree.engine.batch import BatchEngine
    from ddtree.engine.serial import SerialBackend
    from ddtree.fast.batch import PagedBackend

    engine = Engine.from_pretrained(fp8_ckpt / name, fp8_ckpt / "draft", device="cpu")
    pool = BlockManager(48, 8)
    backend = PagedBackend(engine.target, engine.draft, engine.draft_head, pool, max_seqs=4, max_rows=64)
    batch = BatchEngine(engine, [backend, SerialBackend(engine.reference)], max_num_seqs=4,
                        max_num_batched_tokens=64, blocks=pool)
    requests = [(PROMPTS[0], "ddtree", 16), (PROMPTS[1], "dflash", None), (PROMPTS[0][:2], "ar", None)]
    seqs = [batch.add(prompt, GREEDY, method=method, budget=budget) for prompt, method, budget in requests]
    while batch.has_work():
        batch.step()
    for (prompt, method, _), seq in zip(requests, seqs, strict=True):
        assert seq.backend.name == "fast"
        assert seq.generation.token_ids == engine.generate(prompt, GREEDY, method="ar").token_ids, method
    assert pool.free_blocks == pool.num_blocks


@pytest.mark.slow
def test_the_fast_paths_fp8_kernels_give_the_reference_tokens(tmp_path, kernels_on_cpu):
    """The dense FP8 target with the Triton kernels interpreted: block-scaled few-row GEMMs at one row (the AR
    step) and at a tree's rows, the norms quantizing their rows. Two target layers and one draft layer
    (interpreted, every launch is slow)."""
    draft = make_draft(tmp_path / "draft", hidden=HIDDEN, target_layers=2, layers=1, taps=[0, 1])
    target = make_target(tmp_path / "qwen3", "qwen3", hidden=HIDDEN, head_dim=32, layers=2)
    fast = Engine.from_pretrained(make_fp8_checkpoint(target, tmp_path / "qwen3-fp8"), draft, device="cpu",
                                  fast=True, fast_capacity=128)
    assert fast.fast is not None and not fast.fast.row_gemv and fast.fast.ops.quantizing_rows
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)  # (interpreted, 8 tokens: 8 AR steps, 7 or 8 rounds)
    ar = reference.generate(PROMPTS[0], params, method="ar").token_ids
    assert fast.generate(PROMPTS[0], params, method="ar").token_ids == ar
    assert fast.generate(PROMPTS[0], params, method="ddtree", budget=8).token_ids == ar


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["published", "on load"])
def test_the_fast_paths_fp8_expert_kernels_give_the_reference_tokens(tmp_path, kernels_on_cpu, quantization):
    """A Qwen3-MoE with 128-wide experts (the kernels' widths: whole 128-wide scale blocks) in Qwen's published
    128 x 128 blocks and quantized on load per channel, the Triton kernels interpreted: the experts' route, gate/up
    and down kernels at one row (the AR step) and at a tree's rows give the reference path's tokens."""
    draft = make_draft(tmp_path / "draft", hidden=HIDDEN, target_layers=2, layers=1, taps=[0, 1])
    target = make_target(tmp_path / "moe", "qwen3_moe", seed=4, hidden=HIDDEN, head_dim=32, layers=2,
                         moe_intermediate=128)
    if quantization == "published":
        target = make_fp8_checkpoint(target, tmp_path / "moe-fp8")
    fast = Engine.from_pretrained(target, draft, device="cpu", fast=True, fast_capacity=128,
                                  quantization="fp8" if quantization == "on load" else None)
    experts = fast.fast.layers[0].experts
    assert experts.fp8 and experts.kernels_take(torch.zeros(3, HIDDEN))
    assert experts.gate_up.block == (None if quantization == "on load" else (128, 128))
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)  # (interpreted, 8 tokens: 8 AR steps, 7 or 8 rounds)
    ar = reference.generate(PROMPTS[0], params, method="ar").token_ids
    assert fast.generate(PROMPTS[0], params, method="ar").token_ids == ar
    assert fast.generate(PROMPTS[0], params, method="ddtree", budget=8).token_ids == ar


def test_an_fp8_hybrid_moe_decodes_on_the_fast_path(fp8_ckpt):
    """Qwen3.5-MoE's published format (fp8 experts, an fp8 shared expert): dflash and ddtree emit the fast path's own
    AR tokens, on the first prompt the reference path's. On the second the fast path's AR parts from the
    reference's at a near-tie (logprobs -1.45 and -1.50), with the reference's own MLP modules in its place too:
    the hybrid layers' float32 rounding (the fast path's Gated DeltaNet and attention against transformers') moves
    an e4m3 rounding of a later projection's input, as it can for a dense FP8 hybrid."""
    fast = Engine.from_pretrained(fp8_ckpt / "qwen3_5_moe-fp8", fp8_ckpt / "draft", device="cpu", fast=True,
                                  fast_capacity=256)
    assert fast.fast is not None and all(isinstance(layer.mlp.experts, Fp8Experts) for layer in fast.target.layers)
    agree(fast, (("dflash", None), ("ddtree", 16)))
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert (fast.generate(PROMPTS[0], GREEDY, method="ddtree", budget=16).token_ids
            == reference.generate(PROMPTS[0], GREEDY, method="ar").token_ids)


def test_a_moe_quantized_on_load_decodes_on_the_fast_path(fp8_ckpt):
    """Per-channel fp8 experts (--quantization fp8) on the fast path: dflash and ddtree emit the fast path's own AR
    tokens, and the reference path's (on the first prompt the reference path's AR once parted from its own verify:
    PyTorch's float32 CPU SDPA rounded an AR step's one query an ulp away from the same row among a verify's, and an
    e4m3 rounding followed; both CPU paths now sum attention in float64, ddtree/kernels/invariant.py)."""
    fast = Engine.from_pretrained(fp8_ckpt / "moe", fp8_ckpt / "draft", device="cpu", quantization="fp8", fast=True,
                                  fast_capacity=256)
    assert all(layer.experts.fp8 and layer.experts.gate_up.block is None for layer in fast.fast.layers)
    agree(fast, (("dflash", None), ("ddtree", 16)))
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    for prompt in PROMPTS:
        assert (fast.generate(prompt, GREEDY, method="ddtree", budget=16).token_ids
                == reference.generate(prompt, GREEDY, method="ar").token_ids)


@pytest.mark.parametrize("name", ["qwen3", "moe", "qwen3_5"])
def test_quantization_on_load_quantizes_every_projection_per_channel_but_the_routers(fp8_ckpt, name):
    engine = Engine.from_pretrained(fp8_ckpt / name, fp8_ckpt / "draft", device="cpu", quantization="fp8")
    model = engine.target.model
    assert engine.target.quantization == "fp8 (per-channel scales, quantized on load)"
    projections = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert projections and all(m.block is None and m.weight_scale.shape == (m.out_features,) for m in projections)
    kept = [n for n, m in model.model.layers.named_modules() if type(m) is torch.nn.Linear]
    assert all(n.endswith(("mlp.gate", "in_proj_a", "in_proj_b")) for n in kept), kept
    agree(engine, (("ddtree", 16),))


def test_an_fp8_checkpoint_with_quantization_fp8_loads_as_published(fp8_ckpt):
    engine = Engine.from_pretrained(fp8_ckpt / "qwen3-fp8", device="cpu", quantization="fp8", method="ar")
    assert engine.target.quantization.startswith("fp8 (128 x 128 block")


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_method": "awq"}, "quantization method 'awq' is not implemented"),
    ({"quant_method": "compressed-tensors"}, "quantization method 'compressed-tensors' is not implemented"),
    ({"fmt": "e5m2"}, "fp8 format 'e5m2' is not implemented"),
    ({"activation_scheme": "static"}, "fp8 activation scheme 'static' is not implemented"),
    ({"weight_block_size": None}, "per-tensor fp8"),
    ({"weight_block_size": [64, 64]}, r"fp8 weight blocks \[64, 64\] are not implemented"),
])
def test_the_loader_refuses_formats_it_does_not_implement_by_name_in_one_line(fp8_ckpt, tmp_path, change, message):
    shutil.copytree(fp8_ckpt / "qwen3-fp8", tmp_path / "t")
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    config["quantization_config"] = {k: v for k, v in {**FP8_CONFIG, **change}.items() if v is not None}
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeError, match=message) as info:
        Engine.from_pretrained(tmp_path / "t", device="cpu", method="ar")
    assert "\n" not in str(info.value)


def test_an_unknown_target_quantization_and_a_gpu_without_fp8_tensor_cores_are_refused(fp8_ckpt, monkeypatch):
    with pytest.raises(DDTreeError, match="target quantization must be one of none, fp8, got 'int4'"):
        Engine.from_pretrained(fp8_ckpt / "qwen3", device="cpu", quantization="int4", method="ar")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10")
    with pytest.raises(DDTreeError, match=r"an fp8 target needs a GPU with fp8 tensor cores .* NVIDIA A10 is 8\.6"):
        quantize.check_device(torch.device("cuda"), "an fp8 target")


def test_the_server_logs_weights_drafter_and_cache_memory(fp8_ckpt):
    from ddtree.api.engine_setup import memory_line

    engine = Engine.from_pretrained(fp8_ckpt / "qwen3-fp8", fp8_ckpt / "draft", device="cpu", fast=True,
                                    fast_capacity=64)
    line = memory_line(engine, engine.batch(__import__("ddtree.engine.batch", fromlist=["x"]).BatchOptions()))
    weights = stored_bytes(engine.target.model) / 1e9
    assert line.startswith(f"memory: target weights {weights:.2f} GB (fp8 (128 x 128 block scales")
    assert "drafter" in line and "KV and recurrent caches" in line


def group_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M, K] as W8A8 block FP8 reads them (transformers' fine-grained FP8, vLLM's per-token-group
    quantization): one scale per token per 128 columns [M, K / 128], the group's largest magnitude mapped to
    e4m3's 448 (as x float32(1 / 448), ddtree's definition: transformers divides by 448, an ulp apart at most),
    and the e4m3 values."""
    groups = x.float().unflatten(-1, (-1, 128))
    scale = groups.abs().amax(-1).clamp(min=1e-12) * (1.0 / 448.0)
    return (groups / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2), scale


class W8A8Linear(torch.nn.Module):
    """A block-FP8 projection in the float32 W8A8 reference: the checkpoint's e4m3 weight and 128 x 128 block
    scales times the group-quantized rows, as vLLM's W8A8 block-FP8 kernel sums them: per 128-column K block, the
    exact sum of e4m3 products (float64, rounded to float32) times the rows' group scales, times the block's
    weight scales, added in K order in float32."""

    def __init__(self, weight: Fp8Weight) -> None:
        super().__init__()
        self.values = weight.data.double()
        self.scale = weight.scale.repeat_interleave(weight.block[0], dim=0)[:weight.shape[0]]  # [N, K / 128]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, scale = group_quantized(x.reshape(-1, x.shape[-1]))
        values = values.double()
        out = torch.zeros(values.shape[0], self.values.shape[0])
        for g in range(scale.shape[1]):
            block = slice(128 * g, 128 * (g + 1))
            out += (values[:, block] @ self.values[:, block].T).float() * scale[:, g, None] * self.scale[None, :, g]
        return out.view(*x.shape[:-1], -1).to(x.dtype)


class W8A8Experts(torch.nn.Module):
    """transformers' expert loop (Qwen3MoeExperts.forward) over W8A8Linear products."""

    def __init__(self, gate_up: list[Fp8Weight], down: list[Fp8Weight], act: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up, self.down, self.act_fn = [W8A8Linear(w) for w in gate_up], [W8A8Linear(w) for w in down], act

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, position = torch.where(top_k_index == expert)
            gate, up = self.gate_up[expert](hidden_states[token]).chunk(2, dim=-1)
            y = self.down[expert](self.act_fn(gate) * up) * top_k_weights[token, position, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def w8a8_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a loaded block-FP8 target (transformers' model, its fp8 projections the checkpoint's values and
    scales) as the float32 W8A8 reference: every fp8 projection and expert replaced by W8A8Linear / W8A8Experts."""
    import copy

    reference = copy.deepcopy(model)
    for name, module in list(reference.named_modules()):
        parent, _, attr = name.rpartition(".")
        if isinstance(module, Fp8Linear):
            setattr(reference.get_submodule(parent), attr, W8A8Linear(module.fp8))
        elif isinstance(module, Fp8Experts):
            gate_up, down = module.stacked()
            setattr(reference.get_submodule(parent), attr, W8A8Experts(
                [gate_up[e] for e in range(module.num_experts)], [down[e] for e in range(module.num_experts)],
                module.act_fn))
    return reference

@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' forward with its own cache, one greedy token at a time; its float32 products and attention
    correctly rounded (summed in float64: kernels/invariant.py), as ddtree's CPU paths compute them."""
    from ddtree.kernels.invariant import RowInvariant
    from transformers import DynamicCache

    cache, ids, out = DynamicCache(), torch.tensor([prompt]), []
    # transformers renamed `past_key_values` to `cache` (5.2x): an unknown name would run without the cache
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for _ in range(new_tokens):
        with RowInvariant():
            logits = model(input_ids=ids, use_cache=True, **{kwarg: cache}).logits[0, -1]
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(scope="module")
def wide_fp8(tmp_path_factory):
    """Block-FP8 checkpoints wide enough that rows span several 128-column groups: hidden 256, MLP 512, o_proj's K
    256, a MoE's experts 256 wide (weights at std 0.1, so that activations keep their scale over the layers)."""
    root = tmp_path_factory.mktemp("wide_fp8")
    make_draft(root / "draft", hidden=256, taps=[1, 2])
    for arch in ("qwen3", "qwen3_moe"):
        make_target(root / arch, arch, hidden=256, head_dim=64, moe_intermediate=256, initializer_range=0.1)
        make_fp8_checkpoint(root / arch, root / f"{arch}-fp8")
    return root


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_greedy_ar_and_ddtree_on_a_block_fp8_checkpoint_equal_the_per_group_w8a8_reference(wide_fp8, arch):
    """ddtree quantizes a block-scaled projection's rows per token per 128 columns, as transformers and vLLM do, so
    greedy `ar` and `ddtree` on the reference path and the fast path (its PyTorch steps here) emit the float32 W8A8
    reference's tokens (per-row scales part from them within a few tokens)."""
    fast = Engine.from_pretrained(wide_fp8 / f"{arch}-fp8", wide_fp8 / "draft", device="cpu", fast=True,
                                  fast_capacity=256)
    assert fast.fast is not None, fast.fast_unsupported
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    w8a8 = w8a8_reference(fast.target.model)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    for prompt in PROMPTS:
        want = greedy(w8a8, prompt, params.max_new_tokens)
        for engine in (reference, fast):
            for method, budget in (("ar", None), ("ddtree", 16)):
                assert engine.generate(prompt, params, method=method, budget=budget).token_ids == want, (
                    engine.fast is not None, method)


@pytest.mark.parametrize("fast", [False, True])
def test_greedy_ddtree_equals_its_own_ar_where_float32_rows_once_parted_by_an_ulp(wide_fp8, fast):
    """The wide FP8 MoE's AR step rows and its verify's rows came an ulp apart on the CPU (float32 SDPA and the
    router's GEMM pick their order of sums by shape), the ulp moved an e4m3 rounding, and on the first prompt
    ddtree and dflash parted from ar on both paths. The CPU paths now sum those in float64
    (ddtree/kernels/invariant.py): a row's bits are the same at any row count."""
    engine = Engine.from_pretrained(wide_fp8 / "qwen3_moe-fp8", wide_fp8 / "draft", device="cpu", fast=fast,
                                    fast_capacity=256)
    assert (engine.fast is not None) == fast
    agree(engine, (("dflash", None), ("ddtree", 16)))
