"""A DFlash2 drafter on the fast path: its convolutions in the block pass, its selector's transitions, and the
tree over them, all on the device in the round's CUDA graphs.

The block pass is DFlash's (fast/runner.py `draft_logits`) with `conv_layer` as its layer step: each layer
convolves the block's rows around its attention and its MLP (models/dflash2.py `dynamic_conv`, one compiled
kernel on CUDA). `propose` then takes each depth's top-k candidates (kernels/tree.py `vocab_top`), scores every
candidate against every candidate of the depth before in one batched product (the selector's k x k transitions,
dflash2.md §6), and sorts each row, which is what the tree step reads: the best-first tree over the transition
model (kernels/selector.py `selector_prefixes`), or the selector's chain for `dflash`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ddtree.fast.layers import Draft, DraftLayer, Ops, Proj, weight_of
from ddtree.kernels.attention import TreeMask, tree_attention
from ddtree.kernels.gemm import linear
from ddtree.kernels.selector import selector_chain, selector_prefixes
from ddtree.kernels.tree import vocab_top
from ddtree.models.dflash2 import CandidateSelector
from ddtree.models.draft_vocab import DraftHead


@dataclass(frozen=True)
class ConvLayer(DraftLayer):
    """A DFlash2 draft layer: DFlash's, with the dynamic taps' projections and static taps of its two convolution
    pairs."""

    attention_taps: Proj | None = None
    attention_base: torch.Tensor | None = None  # [2, K, H]
    mlp_taps: Proj | None = None
    mlp_base: torch.Tensor | None = None
    taps_shape: tuple[int, int, int] = (2, 1, 1)  # (2, K, H/G): a row of projected taps
    block: int = 1  # rows of one block: a batched pass's rows are whole blocks, each convolved on its own


def _block_conv(ops: Ops, layer: ConvLayer, x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The dynamic convolution of rows x [N, H] that are whole blocks (one, or a batch's), each block on its own."""
    return ops.dynamic_conv(x.unflatten(0, (-1, layer.block)), taps.unflatten(0, (-1, layer.block)), base).flatten(0, 1)


def conv_layer(ops: Ops, layer: ConvLayer, x: torch.Tensor, delta: torch.Tensor | None, cache: torch.Tensor,
               mask: TreeMask, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layers.decoder_layer for a DFlash2 layer over blocks' rows (dflash2.md §3): the normed rows, convolved,
    go to q/k/v; the attention's output is convolved with the same rows' second taps; the same around the MLP.
    The norms hand over plain rows (the convolutions read them), which an fp8 projection quantizes itself."""
    h, x = ops.normed(x, delta, layer.input_norm, eps)
    entering = x
    taps = layer.attention_taps(h).unflatten(-1, layer.taps_shape)
    q = ops.attention_heads(*layer.project(_block_conv(ops, layer, h, taps[:, 0], layer.attention_base[0])),
                            layer.q_norm, layer.k_norm, eps, cos, sin, layer.kv_heads, layer.head_dim, cache, slots)
    attended = _block_conv(ops, layer, layer.o(tree_attention(q, cache, mask)), taps[:, 1], layer.attention_base[1])
    h, x = ops.normed(x, attended, layer.post_norm, eps)
    taps = layer.mlp_taps(h).unflatten(-1, layer.taps_shape)
    out = layer.mlp(ops, _block_conv(ops, layer, h, taps[:, 0], layer.mlp_base[0]))
    return entering, x, _block_conv(ops, layer, out, taps[:, 1], layer.mlp_base[1])


@dataclass(frozen=True)
class SelectorDraft(Draft):
    """A DFlash2 drafter as fused projections: DFlash's, its layers' convolutions, and its candidate selector."""

    selector: CandidateSelector | None = None

    @classmethod
    def of(cls, draft: nn.Module, **more: object) -> SelectorDraft:
        base = Draft.of(draft)
        layers = []
        for fused, layer in zip(base.layers, draft.layers, strict=True):
            attention, mlp = layer.attention_conv, layer.mlp_conv
            layers.append(ConvLayer(
                **{f: getattr(fused, f) for f in DraftLayer.__dataclass_fields__},
                attention_taps=Proj(weight_of(attention.kernel_projection)),
                attention_base=attention.base_kernel.detach(), mlp_taps=Proj(weight_of(mlp.kernel_projection)),
                mlp_base=mlp.base_kernel.detach(), taps_shape=(2, attention.kernel_size, attention.groups),
                block=draft.config.block_size))
        fields = {f: getattr(base, f) for f in Draft.__dataclass_fields__ if f not in ("layers", "layer_step")}
        return cls(layers=layers, layer_step=conv_layer, selector=draft.candidate_selector, **fields, **more)

    def branching(self, head: DraftHead) -> int:
        """Children a tree node can have: the selector's candidates."""
        return min(self.selector.top_k, head.size)

    def propose(self, ops: Ops, x: torch.Tensor, delta: torch.Tensor, head: DraftHead,
                root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's transition model, each row sorted best first: (logp [D, k, k], which candidate each rank is
        [D, k, k], the candidates' tokens [D, k]); the unary scores are the candidates' log-probabilities (their
        logits up to a per-depth constant, which no row's softmax sees)."""
        h, _ = ops.normed(x, delta, self.norm, self.eps)
        logits = self.finish_logits(linear(h, head.weight, head.bias))
        unary, tokens = vocab_top(logits, self.branching(head), head.token_ids)
        logp = self.selector.transition_logp(unary, tokens, h, root)
        ordered, order = torch.sort(logp, dim=-1, descending=True, stable=True)
        return ordered, order, tokens

    def batch_transitions(self, h: torch.Tensor, logits: torch.Tensor, head: DraftHead,
                          roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`propose` for a batch of blocks, from their normed rows h [B, D, H] and logits [B, D, V] (each block's
        first row dropped) and their roots [B]: (logp [B, D, k, k] and which candidate each rank is, each row
        sorted best first; the candidates' tokens [B, D, k])."""
        blocks, depth = logits.shape[:2]
        unary, tokens = vocab_top(logits.flatten(0, 1), self.branching(head), head.token_ids)
        unary, tokens = unary.unflatten(0, (blocks, depth)), tokens.unflatten(0, (blocks, depth))
        logp = self.selector.transition_logp(unary, tokens, h, roots)
        ordered, order = torch.sort(logp, dim=-1, descending=True, stable=True)
        return ordered, order, tokens

    def tree_step(self, method: str, budget: int, token_ids: torch.Tensor | None) -> Callable:
        """The best-first tree over the transitions, or the selector's chain for `dflash`."""
        if method == "ddtree":
            return lambda model: selector_prefixes(*model, budget)
        return lambda model: selector_chain(*model)
