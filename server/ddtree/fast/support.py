"""Which targets the fast path runs, and in words why not: the rest take the reference path (engine/engine.py asks
before it builds a FastPath; engine/batch.py before it batches on the paged path)."""

from __future__ import annotations

from torch import nn

from ddtree.models.fp8_target import Fp8Experts
from ddtree.models.quantize import Fp8Linear
from ddtree.models.target import HybridTarget, Target

ARCHITECTURES = ("qwen3", "llama", "qwen3_moe")


def sparse_block(mlp: nn.Module) -> bool:
    """Whether an MLP is a mixture-of-experts block that fast/moe.py runs: the Qwen3 families' (a top-k router
    over stacked expert weights; Qwen3.5-MoE and Qwen3-Next add a gated SwiGLU shared expert)."""
    experts, router = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    shared = getattr(mlp, "shared_expert", None)
    stacked = isinstance(experts, Fp8Experts) or (
        getattr(experts, "gate_up_proj", None) is not None and getattr(experts, "down_proj", None) is not None
        and experts.gate_up_proj.dim() == 3)
    return (stacked and hasattr(router, "top_k") and hasattr(router, "weight")
            and (shared is None or (hasattr(mlp, "shared_expert_gate")
                                    and all(hasattr(shared, n) for n in ("gate_proj", "up_proj", "down_proj")))))


def unsupported(target: Target) -> str | None:
    """Why the fast path cannot run this target (None when it can)."""
    cfg = target.config
    hybrid = isinstance(target, HybridTarget)
    if not hybrid and cfg.model_type not in ARCHITECTURES:
        return f"model type {cfg.model_type} is not one of {', '.join(ARCHITECTURES)}, nor a hybrid"
    if set(target.layer_types) - {"full_attention", "linear_attention"}:
        return "sliding-window layers use the reference path"
    if not all(hasattr(layer.mlp, "gate_proj") or sparse_block(layer.mlp) for layer in target.layers):
        return "mixture-of-experts blocks other than the Qwen3 families' (top-k experts, an optional shared expert)"
    if not hybrid and any(len({isinstance(m, Fp8Linear) for m in _projections(layer)}) > 1 for layer in target.layers):
        return "decoder layers whose projections mix fp8 and unquantized weights"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act} (the fast path's MLPs are SwiGLU)"
    if any(layer.linear_attn.conv1d.bias is not None for layer in target.layers if hasattr(layer, "linear_attn")):
        return "Gated DeltaNet convolutions with a bias"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = [layer.self_attn for layer in target.layers if hasattr(layer, "self_attn")]
    if any(abs(module.scaling - head_dim**-0.5) > 1e-9 for module in attention):
        return "attention scaling other than 1/sqrt(head_dim)"
    return None


def _projections(layer: nn.Module) -> list[nn.Module]:
    """A dense decoder layer's attention and MLP projections."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj] + [
        getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj") if hasattr(mlp, n)]
