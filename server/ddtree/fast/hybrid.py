"""Hybrid targets on the fast path: Qwen3.5 / Qwen3.6 dense stacks of Gated DeltaNet and gated attention.

The reference path verifies a tree through a recurrent layer depth by depth, with a state per node
(ddtree/models/hybrid.py): up to 16 sequential steps per layer, and a host loop that no graph can replay. Here
each Gated DeltaNet layer takes the whole tree at once in the closed form of fast/delta.py: every node's
output from the committed state, without per-node states. The causal conv reads each node's window along
its own path (`conv_sources`). What the commit needs (the conv inputs, the normed keys, u, G) stays in a
`Recurrent` record that the verify hands to the commit, which installs the state after the last accepted
node for every recurrent layer in one batched product. Prompts run in chunks of PROMPT_CHUNK tokens
through the same layer code (a chunk is a causal chain), so a round and a prompt share one implementation.

The attention layers keep a static K/V cache as in the dense fast path, with the hybrid's gate (q_proj
emits [q ; gate] per head, the output is scaled by sigmoid(gate)) and partial RoPE. Projections that read
the same rows share one weight (a Gated DeltaNet layer's qkv, z, b and a; gate and up), as views of one
tensor (fused.fuse); the norms and the gates between them are compiled into one kernel each on CUDA,
computing what the model's modules compute. Every step keeps fixed shapes, so the same CUDA graphs as the
dense path capture the rounds (fla is not needed).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.fast.delta import conv_sources, path_state, tree_delta_rule
from ddtree.fast.layers import fuse, swiglu, weight_of
from ddtree.fast.runner import FastPath
from ddtree.kernels import gdn
from ddtree.kernels.attention import TreeMask, tree_attention, tree_mask
from ddtree.kernels.gather import embed
from ddtree.kernels.gemm import linear
from ddtree.kernels.invariant import for_fp8_targets
from ddtree.kernels.jit import triton_works
from ddtree.kernels.moe import Experts
from ddtree.kernels.paged_attention import PagedMask
from ddtree.models.hybrid import project, split_heads

PROMPT_CHUNK = 256  # prompt tokens per forward: the closed form's [heads, n, n] products stay small


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: normalise in float32, scale by (1 + weight) in float32, then round."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm of the delta rule's output: normalise, round, scale, times SiLU(gate)."""
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def conv_and_gates(window: torch.Tensor, conv_weight: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal conv over each node's window [n, C, W] with SiLU, beta and the log decay g."""
    conv = F.silu((window * conv_weight).sum(-1))
    return conv, b.sigmoid(), -a_log.float().exp() * F.softplus(a.float() + dt_bias)


NORMS = {f"{arch}RMSNorm{kind}": fn for arch in ("Qwen3_5", "Qwen3_5Moe", "Qwen3Next")  # modules whose math is here
         for kind, fn in (("", offset_rms_norm), ("Gated", gated_rms_norm))}


@dataclass(frozen=True)
class Recurrent:
    """What one target forward leaves for the commit of its recurrent layers (leading dim: those layers)."""

    inputs: torch.Tensor  # [L, W-1 + n, C]: the committed conv columns, then the nodes' conv inputs
    keys: torch.Tensor  # [L, n, H, d_k]: normed keys
    u: torch.Tensor  # [L, n, H, d_v]
    decay: torch.Tensor  # [L, n, H]: G, the log decay from the committed state to each node
    visible: torch.Tensor  # [n, n]
    sources: torch.Tensor  # [n, W]: conv window rows in `inputs`

    def layer(self, index: int) -> Recurrent:
        """Recurrent layer `index`'s record (views: what a layer writes lands in the whole record)."""
        return Recurrent(self.inputs[index], self.keys[index], self.u[index], self.decay[index], self.visible,
                         self.sources)


class HybridLayers:
    """A hybrid decoder's layers on the fast path's ops, apart from any cache: the single-sequence fast path
    (HybridFastPath) runs them over its static caches, the batched one (fast/paged_hybrid.py) over pooled ones.
    A recurrent layer reads and writes the states it is handed; an attention layer the cache and mask it is handed
    (a static cache with a TreeMask, or a paged pool with a PagedMask)."""

    def __init__(self, model: nn.Module, ops, config, device: torch.device) -> None:
        self.ops, self.device = ops, device
        self.decoder = list(model.layers)
        self.mlps = [self._mlp(layer.mlp) for layer in self.decoder]
        for layer in self.decoder:  # a recurrent layer's qkv, z, b, a as one weight
            module = getattr(layer, "linear_attn", None)
            if module is not None and hasattr(module, "in_proj_qkv"):
                fuse(module, "ddtree_in_proj", [module.in_proj_qkv, module.in_proj_z, module.in_proj_b,
                                                module.in_proj_a])
        compiled = {fn: ops.wrap(fn, any_rows=True) for fn in set(NORMS.values())}
        self.norm_ops = {name: compiled[fn] for name, fn in NORMS.items()}
        self.conv_and_gates = ops.wrap(conv_and_gates)
        self.delta_rule = ops.wrap(tree_delta_rule)
        self.recurrent_index = {i: n for n, i in enumerate(i for i, layer in enumerate(self.decoder)
                                                          if hasattr(layer, "linear_attn"))}
        self.gdn_rows = {n for i, n in self.recurrent_index.items()  # recurrent layers whose rounds are one kernel
                         if triton_works(device) and gdn.takes(self.decoder[i].linear_attn)}
        self.attention_index = {i: n for n, i in enumerate(i for i in range(len(self.decoder))
                                                          if i not in self.recurrent_index)}
        first = self.decoder[next(iter(self.recurrent_index))].linear_attn
        self.conv_width, self.conv_dim = first.conv_kernel_size, first.conv_dim
        self.state_shape = (first.num_v_heads, first.head_k_dim, first.head_v_dim)
        attention = self.decoder[next(iter(self.attention_index))].self_attn
        self.rope = importlib.import_module(type(attention).__module__).apply_rotary_pos_emb
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def record(self, n: int, sources: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> Recurrent:
        """Empty commit records of every recurrent layer for a forward of n rows."""
        layers, (heads, d_k, d_v) = len(self.recurrent_index), self.state_shape
        return Recurrent(torch.empty((layers, self.conv_width - 1 + n, self.conv_dim), dtype=dtype, device=self.device),
                         torch.empty((layers, n, heads, d_k), device=self.device),
                         torch.empty((layers, n, heads, d_v), device=self.device),
                         torch.empty((layers, n, heads), device=self.device), visible, sources)

    def _mlp(self, mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """A layer's MLP as a function of its normed rows: SwiGLU, or experts (with their shared expert)."""
        if hasattr(mlp, "gate_proj"):
            return swiglu(mlp, self.ops)
        shared = getattr(mlp, "shared_expert", None)
        return Experts.of(mlp, swiglu(shared, self.ops) if shared is not None else None)

    def norm(self, module, x: torch.Tensor, *gate: torch.Tensor) -> torch.Tensor:
        """A norm module's output: its compiled twin when this file knows its math, else the module itself."""
        fn = self.norm_ops.get(type(module).__name__)
        if fn is None:
            return module(x, *gate)
        eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps  # gated / plain
        return fn(x, *gate, module.weight, eps)

    def recurrent(self, module, h: torch.Tensor, rec: Recurrent, conv_state: torch.Tensor, state: torch.Tensor,
                  kernel: bool) -> torch.Tensor:
        """A Gated DeltaNet layer over a tree (or chain) from the committed conv columns conv_state [W-1, C] and
        state [H, d_k, d_v]: conv along each node's path, then the closed-form delta rule (in the Triton kernels
        with `kernel`, up to gdn.TREE_MAX rows); what the commit needs goes to `rec`, this layer's record."""
        n = h.shape[0]
        if n <= gdn.TREE_MAX and kernel:  # Triton kernels between the projections
            proj = module.ddtree_in_proj(h)
            record = (rec.keys, rec.u, rec.decay)
            if n == 1:  # an AR step, gated norm included
                return _project(module.out_proj, gdn.row_step(module, proj, conv_state, state, rec.inputs, *record))
            out = gdn.tree_step(module, proj, conv_state, state, rec.inputs, rec.sources, rec.visible, *record)
            return self.gated_out(module, out, proj[:, module.conv_dim:module.conv_dim + module.value_dim])
        if hasattr(module, "ddtree_in_proj"):  # one GEMM for the four (the reference path keeps its four)
            qkv, z, b, a = module.ddtree_in_proj(h).split(
                [module.conv_dim, module.value_dim, module.num_v_heads, module.num_v_heads], dim=-1)
        else:
            qkv, z, b, a = project(module, h)
        rec.inputs[:self.conv_width - 1] = conv_state
        rec.inputs[self.conv_width - 1:] = qkv
        window = rec.inputs[rec.sources].transpose(1, 2)  # [n, C, W], as the reference's windows
        conv, beta, g = self.conv_and_gates(window, module.conv1d.weight[:, 0], b, a, module.A_log,
                                            module.dt_bias)
        q, k, v = split_heads(module, conv)
        out, keys, u, decay = self.delta_rule(q, k, v, g, beta, rec.visible, state)
        rec.keys.copy_(keys)
        rec.u.copy_(u)
        rec.decay.copy_(decay)
        return self.gated_out(module, out.to(h.dtype), z)

    def gated_out(self, module, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The delta rule's output o (model dtype) through the gated norm with z, then the output projection."""
        n = z.shape[0]
        out = self.norm(module.norm, out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return _project(module.out_proj, out.reshape(n, -1))

    def attention(self, module, cache: torch.Tensor, h: torch.Tensor, mask: TreeMask | PagedMask,
                  slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A gated attention layer: q and its gate from one projection, q/k norms, partial RoPE, the rows'
        K/V into the cache at `slots`, tree attention, the gate, the output projection."""
        n, d = h.shape[0], self.head_dim
        q, gate = torch.chunk(_project(module.q_proj, h).view(n, -1, 2 * d), 2, dim=-1)
        q = self.norm(module.q_norm, q)
        k = self.norm(module.k_norm, _project(module.k_proj, h).view(n, -1, d))
        v = _project(module.v_proj, h).view(n, -1, d)
        q, k = self.rope(q, k, cos, sin, unsqueeze_dim=1)
        cache[:, :, slots] = torch.stack([k, v]).transpose(1, 2)
        groups = q.shape[1] // self.kv_heads
        grouped = q.reshape(n, self.kv_heads, groups, d).permute(1, 2, 0, 3).reshape(self.kv_heads, groups * n, d)
        return _project(module.o_proj, tree_attention(grouped, cache, mask) * torch.sigmoid(gate.reshape(n, -1)))


class HybridFastPath(FastPath):
    """FastPath for a hybrid target: recurrent layers in closed form, attention layers over a static cache."""

    pools_prompts = False  # a pooled prompt would need its recurrent states checkpointed at block boundaries
    graphs_prompts = False  # its prompt commits the recurrent states chunk by chunk (prompt_forward)

    def _build_target(self) -> None:
        self.row_gemv = False
        self.hybrid = HybridLayers(self.model, self.ops, self.target.config, self.device)
        self.kv = self._kv_cache(len(self.hybrid.attention_index))
        self.conv_width = self.hybrid.conv_width
        self.conv_state = torch.zeros((len(self.hybrid.recurrent_index), self.conv_width - 1, self.hybrid.conv_dim),
                                      dtype=self.dtype, device=self.device)
        self.recurrent_state = torch.zeros((len(self.hybrid.recurrent_index), *self.hybrid.state_shape),
                                           dtype=torch.float32, device=self.device)

    # -- the forward ------------------------------------------------------------------------------------

    @for_fp8_targets
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, Recurrent]:
        n = ids.numel()
        hybrid = self.hybrid
        mask = tree_mask(self.start, visible, self.capacity, self.heads // self.kv_heads, self.head_dim, self.dtype)
        slots = self.start + self.steps[:n]
        x = embed(self.model.embed_tokens, ids)
        cos, sin = self.target_rope(positions)
        rec = hybrid.record(n, conv_sources(visible, positions - self.start, self.conv_width), visible, self.dtype)
        tapped = []
        for i, layer in enumerate(hybrid.decoder):
            h = hybrid.norm(layer.input_layernorm, x)
            if i in hybrid.recurrent_index:
                index = hybrid.recurrent_index[i]
                mixed = hybrid.recurrent(layer.linear_attn, h, rec.layer(index), self.conv_state[index],
                                         self.recurrent_state[index], index in hybrid.gdn_rows)
            else:
                mixed = hybrid.attention(layer.self_attn, self.kv[hybrid.attention_index[i]], h, mask, slots, cos, sin)
            x = x + mixed
            x = x + hybrid.mlps[i](hybrid.norm(layer.post_attention_layernorm, x))
            tapped.append(x)
        logits = _project(self.target.lm_head, hybrid.norm(self.model.norm, x[-1:] if last_only else x))
        taps = torch.cat([tapped[t] for t in self.taps], dim=-1) if self.taps else None
        return logits, taps, rec

    # -- prompt and commit ------------------------------------------------------------------------------

    def prompt_forward(self, prompt: torch.Tensor, positions: torch.Tensor, causal: torch.Tensor,
                       every_row: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt in causal chunks, each committed before the next: (the last row's logits, or with
        `every_row` every row's; every row's taps)."""
        self.conv_state.zero_()
        self.recurrent_state.zero_()
        taps, logits = [], []
        for lo in range(0, prompt.numel(), PROMPT_CHUNK):
            hi = min(lo + PROMPT_CHUNK, prompt.numel())
            visible = causal[lo:hi, lo:hi].contiguous()  # the kernels read a mask's rows at stride hi - lo
            chunk_logits, chunk_taps, rec = self.forward(prompt[lo:hi], positions[lo:hi], visible,
                                                         last_only=not every_row)
            self._commit_recurrent(rec, torch.tensor(hi - lo - 1, device=self.device))
            self.start.fill_(hi)
            taps.append(chunk_taps)
            logits.append(chunk_logits)
        return torch.cat(logits) if every_row else logits[-1], torch.cat(taps) if self.taps else None

    def commit(self, path: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor, taps: torch.Tensor | None,
               with_draft: bool, recurrent: object = None) -> None:
        self._commit_recurrent(recurrent, path.gather(0, (length - 1).view(1))[0])
        super().commit(path, length, bonus, taps, with_draft)

    def _commit_recurrent(self, rec: Recurrent, last: torch.Tensor) -> None:
        """Every recurrent layer's state and conv window become those after node `last` (a device index)."""
        self.recurrent_state.copy_(path_state(rec.keys, rec.u, rec.decay, rec.visible, self.recurrent_state, last))
        newest = rec.sources.index_select(0, last.view(1))[0, 1:]  # the window after `last`, minus its oldest
        self.conv_state.copy_(rec.inputs.index_select(1, newest))


def _project(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A module's linear map through `linear` (the few-row GEMM where it pays), on the module's own weights."""
    return linear(x, weight_of(module), module.bias)
