"""The mixture-of-experts kernels against transformers' sparse block."""


import pytest
import torch
from cases import SmallGPU
from ddtree.kernels import jit
from marks import gpu, interpreted
from tiny import make_target


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_experts_equal_the_sparse_block_at_real_widths(dtype):
    """Qwen3-30B-A3B's widths (128 experts, 8 a token, 2048 -> 768): at an AR row (a run per pair), at trees
    of B = 16 and 64 and at a prompt chunk (a run per expert, some experts empty, some runs longer than one
    16-row tile). float32 against transformers' block; bf16 against the PyTorch steps on the same routing
    (transformers' router rounds its logits through another GEMM, which can flip a near-tie pick)."""
    from ddtree.kernels.moe import Experts
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg).to("cuda", dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    experts = Experts.of(block)
    for rows in (1, 17, 65, 256):
        h = torch.randn(rows, 2048, device="cuda").to(dtype)
        assert experts.kernels_take(h)
        with torch.no_grad():
            got = experts.routed_by_kernels(h)
            if dtype == torch.float32:
                want = block(h[None])[0]
                assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (rows, (got - want).abs().max())
            else:
                want = experts.routed_by_torch(h)
                assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=2e-2), (rows, (got - want).abs().max())


@interpreted
def test_moe_experts_on_a_gpu_with_little_shared_memory_fit_their_tiles_and_stay_right(tmp_path, monkeypatch):
    """In float32 the gate/up kernel's tuned tiles need 144 KB of shared memory, more than a consumer GPU has
    (benchmarks/kernel_resources.py): both expert kernels shrink their tiles rather than fail."""
    from ddtree.kernels import moe
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(jit, "_FITTED", {})
    monkeypatch.setattr(jit, "INTERPRETED_ON_CPU", True)
    small_up = SmallGPU(moe._up_kernel, {"num_stages": 1, "BLOCK_N": 32})
    small_down = SmallGPU(moe._down_kernel, {"num_stages": 2, "BLOCK_N": 64})
    monkeypatch.setattr(moe, "_up_kernel", small_up)
    monkeypatch.setattr(moe, "_down_kernel", small_down)
    make_target(tmp_path / "moe", "qwen3_moe", seed=4)
    mlp = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).model.layers[0].mlp
    experts = moe.Experts.of(mlp)
    h = torch.randn(3, mlp.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    assert experts.kernels_take(h)
    with torch.no_grad():
        want = mlp(h[None])[0]
        got = experts.routed_by_kernels(h)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), (got - want).abs().max()
    assert small_up.tried == [{"num_stages": 3, "BLOCK_N": 64}, {"num_stages": 2, "BLOCK_N": 64},
                              {"num_stages": 1, "BLOCK_N": 64}, {"num_stages": 1, "BLOCK_N": 32}]
    assert small_down.tried == [{"num_stages": 3, "BLOCK_N": 64}, {"num_stages": 2, "BLOCK_N": 64}]
    small_up.tried.clear()  # the next call (a graph capture after its warm-up) launches the fit at once
    experts.routed_by_kernels(h)
    assert small_up.tried == [{"num_stages": 1, "BLOCK_N": 32}]
