"""Fused weights and fused elementwise steps: the fast path's forward passes in few, large kernels.

At batch 1 a decoder layer is bound by reading its weights; on a GPU, what it loses beyond that is kernel
count (transformers' RMSNorm is seven kernels, its RoPE about ten per tensor). Here a target layer is
about ten kernels:

    add + norm | qkv GEMM | q/k norm + RoPE + head layout + KV write | attention | o GEMM |
    add + norm | gate+up GEMM | SiLU * up | down GEMM

On CUDA the q/k norm + RoPE + KV write step is one Triton kernel (ddtree/kernels/heads.py), a single row
(an AR step) folds the add + norm and SiLU * up steps into Triton GEMVs (ddtree/kernels/gemv.py), and more rows
take them as Triton kernels of their own (ddtree/kernels/rows.py, `Ops.take_row_kernels`).

Projections that read the same input share one weight: q, k and v; gate and up; and, in the drafter, the
k and v of every layer (context rows are projected by all layers at once). The original modules'
weights become row views of the fused tensor, so nothing is stored twice and the reference path keeps
working on the same parameters. On CUDA the other elementwise steps are compiled (torch.compile: one Triton
kernel each); elsewhere they run eagerly, the same functions the CPU tests compare with the reference.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels import rows
from ddtree.kernels.attention import TreeMask, tree_attention, tree_mask
from ddtree.kernels.fp8 import Fp8Weight, QuantizedRows, activation_group, expand_rows
from ddtree.kernels.gemm import fp8_supported, linear, pair_linear, rows_of, silu_mul_linear
from ddtree.kernels.gemv import NORM, SILU, gemv, norm_gemv
from ddtree.kernels.moe import Experts
from ddtree.kernels.tree import chain, top_prefixes
from ddtree.models.dflash2 import dynamic_conv
from ddtree.models.draft import rms_norm
from ddtree.models.draft_vocab import DraftHead
from ddtree.models.quantize import Fp8Linear
from ddtree.switches import SWITCHES


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + delta), residual + delta): a layer's residual add fused with the next norm."""
    residual = residual + delta
    return rms_norm(residual, weight, eps), residual


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention; cos/sin broadcast against x [..., d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def attention_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    kv_heads: int, head_dim: int, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Projected rows q [n, H*d], k, v [n, kv*d] -> queries grouped by K/V head [kv, groups*n, d]; the rows'
    K/V go to cache [2, kv, T, d] at `slots` (written in place, by the same kernel when compiled).

    Per-head q/k norm (Qwen3; None for Llama), then RoPE (cos/sin [n, d]). Queries that share a K/V head
    are stacked along the query axis so attention reads each cached row once per K/V head.
    """
    n = q.shape[0]
    q, k, v = q.reshape(n, -1, head_dim), k.reshape(n, kv_heads, head_dim), v.reshape(n, kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
    groups = q.shape[1] // kv_heads
    cache[:, :, slots] = torch.stack([k, v]).transpose(1, 2)
    return q.view(n, kv_heads, groups, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, head_dim)


def context_heads(kv: torch.Tensor, k_norms: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  kv_heads: int, head_dim: int) -> torch.Tensor:
    """Every draft layer's K/V of context rows at once: kv [n, L*2*kv*d] -> [L, 2, kv, n, d].

    k is normed with each layer's k_norm (k_norms [L, d]) and rotated; v is taken as projected.
    """
    n, layers = kv.shape[0], k_norms.shape[0]
    kv = kv.view(n, layers, 2, kv_heads, head_dim)
    k = rope(rms_norm(kv[:, :, 0], k_norms[:, None], eps), cos[:, None, None], sin[:, None, None])
    return torch.stack([k, kv[:, :, 1]], dim=2).permute(1, 2, 3, 0, 4)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's SiLU(gate) * up over the fused [.., 2I] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Ops:
    """The elementwise steps above: compiled on CUDA (one kernel each), eager elsewhere or with DDTREE_COMPILE=0
    (ddtree.switches).

    A compile that fails (no C compiler, an unsupported torch build) falls back to the eager function for
    good, with the reason on stderr: slower, never wrong.
    """

    def __init__(self, compile: bool) -> None:
        self.compiled = compile and SWITCHES.compile
        for fn in (rms_norm, add_rms_norm, attention_heads, context_heads, silu_mul, dynamic_conv):
            setattr(self, fn.__name__, self.wrap(fn))
        self.quantizing_rows = False  # the row kernels' fp8 forms (see normed), once take_row_kernels has run
        self.folding_silu = False  # SiLU · up in the gate/up GEMM (see swiglu), likewise: the row kernel's bits

    def normed(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
               fp8: bool = False, group: int | None = None) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """(norm(x + delta), x + delta), or without `delta` (norm(x), x): the rows a layer's projections read, and
        its residual. With `fp8` (the projections' weights are) the normed rows come quantized, one scale per row
        or per `group` columns (the weights' fp8.activation_group): in the norm's own kernel where the row kernels
        run, else quantized after it (ddtree/kernels/rows.py: the same bits in bf16)."""
        if (fp8 and self.quantizing_rows and rows.supported(x, weight) and fp8_supported(x)
                and (delta is None or rows.supported(delta, weight))):
            return rows.rms_norm_fp8(x, delta, weight, eps, group)
        if delta is None:
            h = self.rms_norm(x, weight, eps)
        else:
            h, x = self.add_rms_norm(x, delta, weight, eps)
        return (rows_of(h, group) if fp8 else h), x

    def swiglu(self, h: torch.Tensor, gate_up: Proj) -> torch.Tensor:
        """SiLU(gate) · up of the normed rows h through the fused gate/up projection: in the projection's own
        epilogue where the row kernels run and our Hopper GEMM takes the product (the same bits as the SiLU · up
        kernel after it: ddtree/kernels/wgmma.py), else the projection, then silu_mul."""
        if self.folding_silu and gate_up.bias is None and not gate_up.fp8:
            act = silu_mul_linear(h, gate_up.weight)
            if act is not None:
                return act
        return self.silu_mul(gate_up(h))

    def silu_mul_fp8(self, gate_up: torch.Tensor, group: int | None = None) -> QuantizedRows:
        """silu_mul's rows quantized for an fp8 projection (per row, or per `group` columns): by the SiLU kernel
        itself where the row kernels run."""
        if self.quantizing_rows and rows.supported(gate_up) and fp8_supported(gate_up[:, :gate_up.shape[1] // 2]):
            return rows.silu_mul_fp8(gate_up, group)
        return rows_of(self.silu_mul(gate_up), group)

    def wrap(self, fn: Callable, any_rows: bool = False) -> Callable:
        """`fn` compiled (with the eager fallback) when this Ops compiles, else `fn` itself. `any_rows`: one graph
        for every row count (the first dimension of its tensors of two or more dimensions), not one per count
        seen: a function called on every bucket's rows would otherwise reach dynamo's recompile limit."""
        return _compiled(fn, any_rows) if self.compiled else fn

    def take_row_kernels(self) -> None:
        """The norms and SiLU · up as ddtree/kernels/rows.py's Triton kernels, for the rows those take (the
        current functions for the rest). The caller checks that Triton runs on its device."""
        norm, add_norm, silu = self.rms_norm, self.add_rms_norm, self.silu_mul
        self.rms_norm = lambda x, w, eps: rows.rms_norm(x, w, eps) if rows.supported(x, w) else norm(x, w, eps)
        self.add_rms_norm = lambda x, d, w, eps: (rows.add_rms_norm(x, d, w, eps) if rows.supported(x, w)
                                                  and rows.supported(d, w) else add_norm(x, d, w, eps))
        self.silu_mul = lambda x: rows.silu_mul(x) if rows.supported(x) else silu(x)
        self.quantizing_rows = self.folding_silu = True


def _compiled(fn: Callable, any_rows: bool = False) -> Callable:
    from torch._dynamo.decorators import mark_unbacked  # dynamo loads only where something compiles

    state = {"fn": torch.compile(fn, fullgraph=True)}

    def call(*args: object) -> object:
        if any_rows:
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.dim() >= 2:
                    mark_unbacked(arg, 0)  # no guard on the count, not even 0 or 1
        try:
            return state["fn"](*args)
        except Exception as exc:  # a compiler or backend failure, not the function's own error
            if state["fn"] is fn:
                raise
            print(f"ddtree fast path: compiling {fn.__name__} failed ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); running it eagerly", file=sys.stderr)
            state["fn"] = fn
            return fn(*args)

    return call


@dataclass(frozen=True)
class Proj:
    """One (possibly fused) linear projection; an fp8 weight for a quantized drafter's (ddtree.quantize)."""

    weight: torch.Tensor | Fp8Weight
    bias: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        """Whether the weight is fp8: then the projection reads quantized rows best (Ops.normed)."""
        return isinstance(self.weight, Fp8Weight)

    @property
    def group(self) -> int | None:
        """The columns one scale of the quantized rows it reads covers (fp8.activation_group; None: a row)."""
        return activation_group(self.weight) if self.fp8 else None

    def __call__(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def weight_of(module: nn.Module) -> torch.Tensor | Fp8Weight:
    """A projection module's weight: an nn.Linear's, or an Fp8Linear's fp8 values with their scales."""
    return module.fp8 if isinstance(module, Fp8Linear) else module.weight


@dataclass(frozen=True)
class Joined:
    """Projections of one input whose weights differ in format (an FP8 target's Gated DeltaNet qkv and z in fp8,
    its b and a kept in bf16), their outputs side by side: one product per format."""

    parts: tuple[Proj, ...]
    fp8 = False  # its rows come unquantized: each fp8 part quantizes them itself

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse(owner: nn.Module, name: str, linears: list[nn.Module]) -> Proj | Joined:
    """One projection computing every linear in `linears` (same input), their outputs concatenated.

    The fused weight is kept on `owner` under `name` (so building a second fast path reuses it) and each
    linear's weight (and bias, or an Fp8Linear's scales) becomes a row view of it: the memory is not doubled.
    One kept for the modules' earlier format (a draft quantized after a fast path fused it) is made again.
    Linears in different formats are fused per run of one format (`Joined`). Block-scaled fp8 weights whose rows
    do not end on a scale block first give each row its own K-block scales (fp8.expand_rows).
    """
    runs = [[linears[0]]]
    for m in linears[1:]:
        same = isinstance(m, Fp8Linear) == isinstance(runs[-1][0], Fp8Linear)
        runs[-1].append(m) if same else runs.append([m])
    if len(runs) > 1:
        joined = Joined(tuple(fuse(owner, f"{name}_{i}", run) for i, run in enumerate(runs)))
        setattr(owner, name, joined)
        return joined
    kept = getattr(owner, name, None)
    if kept is None or kept.fp8 != isinstance(linears[0], Fp8Linear):
        if isinstance(linears[0], Fp8Linear):
            rows = linears[0].block[0] if linears[0].block else 1
            if any(m.out_features % rows for m in linears[:-1]):
                for m in linears:
                    wide = expand_rows(m.fp8)
                    m.weight_scale, m.block = wide.scale, wide.block
            fused = Proj(Fp8Weight(_concat_rows([m.weight for m in linears]),
                                   _concat_rows([m.weight_scale for m in linears]), linears[0].block))
            shared = [("weight", fused.weight.data), ("weight_scale", fused.weight.scale)]
        else:
            fused = Proj(_concat_rows([m.weight for m in linears]),
                         _concat_rows([m.bias for m in linears]) if linears[0].bias is not None else None)
            shared = [("weight", fused.weight)] + ([("bias", fused.bias)] if fused.bias is not None else [])
        for attribute, whole in shared:  # each module's tensor becomes its rows of the fused one
            row = 0
            for m in linears:
                tensor = getattr(m, attribute)
                tensor.data = whole[row:row + tensor.shape[0]]
                row += tensor.shape[0]
        setattr(owner, name, fused)
    return getattr(owner, name)


def swiglu(mlp: nn.Module, ops: Ops) -> Callable[[torch.Tensor], torch.Tensor]:
    """A SwiGLU MLP module (gate_proj, up_proj, down_proj) as a function of its normed rows: gate and up as one
    weight (`fuse`), SiLU · up as one step, then down."""
    gate_up = fuse(mlp, "ddtree_gate_up", [mlp.gate_proj, mlp.up_proj])
    return lambda h: linear(ops.swiglu(h, gate_up), weight_of(mlp.down_proj), mlp.down_proj.bias)


def _concat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach() for t in tensors])


@dataclass(frozen=True)
class Layer:
    """An attention + SwiGLU decoder layer as fused projections and norm weights (see `project`)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    o: Proj
    gate_up: Proj | None  # None in a mixture-of-experts layer (TargetLayer.experts)
    down: Proj | None
    q_norm: torch.Tensor | None  # per-head q/k norms (Qwen3, DFlash); None for Llama
    k_norm: torch.Tensor | None
    kv_heads: int
    head_dim: int

    @property
    def fp8(self) -> bool:
        """Whether the projections are fp8 (a quantized drafter's): then they read quantized rows (Ops.normed)."""
        return self.o.fp8

    @property
    def fp8_group(self) -> int | None:
        """The columns one scale of the attention's quantized rows covers: its projections share o's format."""
        return self.o.group

    @property
    def mlp_fp8(self) -> bool:
        """Whether the MLP reads quantized rows: fp8 SwiGLU projections. Experts read the rows as they are (their
        router is not quantized; fp8 experts quantize the rows as they route them: ddtree/kernels/moe.py)."""
        return self.gate_up is not None and self.gate_up.fp8

    @property
    def mlp_group(self) -> int | None:
        """The columns one scale of the MLP's quantized rows covers (its gate/up's format)."""
        return self.gate_up.group if self.gate_up is not None else None

    def project(self, h: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) of the normed rows h."""
        raise NotImplementedError

    def mlp(self, ops: Ops, h: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """The MLP's output for the normed rows h."""
        if self.mlp_fp8:
            return self.down(ops.silu_mul_fp8(self.gate_up(h), self.down.group))
        return self.down(ops.swiglu(h, self.gate_up))


@dataclass(frozen=True)
class TargetLayer(Layer):
    """A Qwen3 / Llama / Qwen3-MoE target layer: q, k and v in one GEMM; a SwiGLU MLP, or experts."""

    qkv: Proj
    splits: tuple[int, int, int]  # q, k, v widths of qkv's output
    experts: Experts | None = None

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv(h).split(self.splits, dim=-1)

    def mlp(self, ops: Ops, h: torch.Tensor) -> torch.Tensor:
        return self.experts(h) if self.experts is not None else super().mlp(ops, h)

    @classmethod
    def of(cls, layer: nn.Module) -> TargetLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fuse(attn, "ddtree_qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
        has_qk_norm = hasattr(attn, "q_norm")
        experts = Experts.of(mlp) if hasattr(mlp, "experts") else None
        gate_up = None if experts else fuse(mlp, "ddtree_gate_up", [mlp.gate_proj, mlp.up_proj])
        down = None if experts else Proj(weight_of(mlp.down_proj), mlp.down_proj.bias)
        return cls(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   Proj(weight_of(attn.o_proj), attn.o_proj.bias), gate_up, down,
                   attn.q_norm.weight if has_qk_norm else None, attn.k_norm.weight if has_qk_norm else None,
                   attn.k_proj.out_features // attn.head_dim, attn.head_dim, qkv,
                   (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features), experts)


@dataclass(frozen=True)
class DraftLayer(Layer):
    """A DFlash draft layer: q alone (block rows only), k+v as a slice of the all-layer context projection."""

    q: Proj
    kv: Proj

    def project(self, h: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k/v in one launch where the few-row kernel takes both weights (`pair_linear`), else two; fp8: h
        was quantized once for both."""
        both = pair_linear(h, self.q.weight, self.kv.weight) if self.q.bias is None and self.kv.bias is None else None
        if both is None:
            return self.q(h), *self.kv(h).chunk(2, dim=-1)
        q, kv = both.split([self.q.weight.shape[0], self.kv.weight.shape[0]], dim=-1)
        return q, *kv.chunk(2, dim=-1)


@dataclass(frozen=True)
class Draft:
    """A DFlash drafter as fused projections: fc, every layer's context k+v in one weight, and the layers; with
    what its block pass needs besides (each layer's causality, window and sinks, the embedding scale, the
    logits' multiplier and cap). A DFlash2 drafter is a SelectorDraft (fast/dflash2.py)."""

    fc: Proj
    context_kv: Proj
    k_norms: torch.Tensor  # [L, head_dim]
    layers: list[DraftLayer]
    norm: torch.Tensor  # the final norm's weight
    eps: float
    rules: tuple[tuple[int | None, bool], ...]  # per layer: (window, causal)
    block_visible: dict[tuple[int | None, bool], torch.Tensor]  # per rule: [bs, bs] bool, which block rows each sees
    sinks: tuple[torch.Tensor | None, ...]  # per layer: float32 sink logits per query head, or None
    embedding_scale: float
    finish_logits: Callable[[torch.Tensor], torch.Tensor]  # the checkpoint's output multiplier and softcap
    # the block pass's layer step: None for the target's decoder layer (decoder_layer below)
    layer_step: Callable | None = None

    @classmethod
    def of(cls, draft: nn.Module, **more: object) -> Draft:
        cfg = draft.config
        kv_linears = [m for layer in draft.layers for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        context_kv = fuse(draft, "ddtree_context_kv", kv_linears)
        width = 2 * draft.layers[0].self_attn.k_proj.out_features
        layers = []
        for i, layer in enumerate(draft.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(DraftLayer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, Proj(weight_of(attn.o_proj)),
                fuse(mlp, "ddtree_gate_up", [mlp.gate_proj, mlp.up_proj]), Proj(weight_of(mlp.down_proj)),
                attn.q_norm.weight, attn.k_norm.weight, attn.num_kv_heads, attn.head_dim,
                Proj(weight_of(attn.q_proj)), Proj(_rows(context_kv.weight, i * width, (i + 1) * width))))
        k_norms = torch.stack([layer.self_attn.k_norm.weight.detach() for layer in draft.layers])
        device = draft.norm.weight.device
        steps = torch.arange(cfg.block_size, device=device)
        rel = steps[:, None] - steps[None, :]
        visible = {}
        for window, causal in set(cfg.layer_rules):  # the block-to-block part of DFlashDraft._layer_masks' rules
            seen = rel >= 0 if causal else torch.ones_like(rel, dtype=torch.bool)
            visible[window, causal] = seen if window is None else seen & ((rel if causal else rel.abs()) < window)
        sinks = tuple(None if layer.self_attn.sinks is None else layer.self_attn.sinks.detach().float()
                      for layer in draft.layers)
        return cls(Proj(weight_of(draft.fc)), context_kv, k_norms, layers, draft.norm.weight, cfg.rms_norm_eps,
                   cfg.layer_rules, visible, sinks, cfg.input_embedding_scale, draft.finish_logits, **more)

    def context(self, ops: Ops, draft: nn.Module, feats: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Committed rows' context K/V for every draft layer, from their tap features: fc, the hidden norm, then
        every layer's k and v in one projection (k normed and rotated), as the draft cache holds them."""
        dc = draft.config
        ctx, _ = ops.normed(self.fc(feats), None, draft.hidden_norm.weight, dc.rms_norm_eps, self.context_kv.fp8)
        return ops.context_heads(self.context_kv(ctx), self.k_norms, dc.rms_norm_eps, cos, sin, dc.num_kv_heads,
                                 dc.head_dim)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The block's target embeddings as the drafter reads them (input_embedding_scale)."""
        return x * self.embedding_scale if self.embedding_scale != 1.0 else x

    def masks(self, start: torch.Tensor, capacity: int, dtype: torch.dtype) -> list[TreeMask]:
        """Each layer's attention mask for the block at `start`: every committed context row (within the layer's
        window) and the block rows its rule shows, with the layer's sinks."""
        layer = self.layers[0]
        groups = self.q_heads // layer.kv_heads
        by_rule = {rule: tree_mask(start, visible, capacity, groups, layer.head_dim, dtype, rule[0])
                   for rule, visible in self.block_visible.items()}
        return [by_rule[rule] if sinks is None else replace(by_rule[rule], sinks=sinks)
                for rule, sinks in zip(self.rules, self.sinks, strict=True)]

    @property
    def q_heads(self) -> int:
        layer = self.layers[0]
        return layer.q.weight.shape[0] // layer.head_dim

    def branching(self, head: DraftHead) -> int:
        """Children a tree node can have: every token the head scores."""
        return head.size

    def propose(self, ops: Ops, x: torch.Tensor, delta: torch.Tensor, head: DraftHead,
                root: torch.Tensor) -> torch.Tensor:
        """What the tree step reads from the block's last layer (rows below the anchor, residual still to add):
        the logits [D, V] over the head's columns."""
        h, _ = ops.normed(x, delta, self.norm, self.eps, isinstance(head.weight, Fp8Weight))
        return self.finish_logits(linear(h, head.weight, head.bias))

    def tree_step(self, method: str, budget: int, token_ids: torch.Tensor | None) -> Callable:
        """The round's tree step over `propose`'s output: the best-first tree, or the argmax chain for `dflash`."""
        if method == "ddtree":
            return lambda logits: top_prefixes(logits, budget, token_ids)
        return lambda logits: chain(logits, token_ids)


def _rows(weight: torch.Tensor | Fp8Weight, start: int, end: int) -> torch.Tensor | Fp8Weight:
    """Rows start..end-1 of a weight (with their scales, for an fp8 one)."""
    return weight.rows(start, end) if isinstance(weight, Fp8Weight) else weight[start:end]


def decoder_layer(ops: Ops, layer: Layer, x: torch.Tensor, delta: torch.Tensor | None, cache: torch.Tensor,
                  mask: TreeMask, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer whose residual adds are deferred into the next norm: the rows' new K/V go to
    cache [2, kv, T, d] at `slots`. Returns (the residual entering the layer, i.e. the previous layer's
    output; the residual after attention; the MLP's output, still to be added)."""
    h, x = ops.normed(x, delta, layer.input_norm, eps, layer.fp8, layer.fp8_group)
    entering = x
    q = ops.attention_heads(*layer.project(h), layer.q_norm, layer.k_norm, eps, cos, sin, layer.kv_heads,
                            layer.head_dim, cache, slots)
    h, x = ops.normed(x, layer.o(tree_attention(q, cache, mask)), layer.post_norm, eps, layer.mlp_fp8,
                      layer.mlp_group)
    return entering, x, layer.mlp(ops, h)


def decoder_row(ops: Ops, layer: TargetLayer, x: torch.Tensor, delta: torch.Tensor | None, cache: torch.Tensor,
                mask: TreeMask, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decoder_layer for a single row (an AR step): every projection is a Triton GEMV, and the residual adds,
    the norms and SiLU · up are computed inside the GEMVs that read them (ddtree/kernels/gemv.py): three
    kernels fewer per layer, and no cuBLAS split-K pass for the narrow weights. In a mixture-of-experts
    layer the router's GEMV builds the normed row, and hands it on to the experts."""
    qkv, x = gemv(x, layer.qkv.weight, NORM, delta, layer.input_norm, eps)
    q = ops.attention_heads(*qkv.split(layer.splits, dim=-1), layer.q_norm, layer.k_norm, eps, cos, sin,
                            layer.kv_heads, layer.head_dim, cache, slots)
    attended = gemv(tree_attention(q, cache, mask), layer.o.weight)[0]
    if layer.experts is not None:
        logits, after, h = norm_gemv(x, layer.experts.router, attended, layer.post_norm, eps)
        return x, after, layer.experts(h, logits)
    gate_up, after = gemv(x, layer.gate_up.weight, NORM, attended, layer.post_norm, eps)
    return x, after, gemv(gate_up, layer.down.weight, SILU)[0]
