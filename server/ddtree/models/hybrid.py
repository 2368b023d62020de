"""Tree-aware verification for hybrid targets (Qwen3.5 / Qwen3.6 / Qwen3-Next Gated DeltaNet layers).

An attention mask cannot verify a tree through a recurrent layer: its state summarises every earlier
token, siblings included. So we replace each Gated DeltaNet layer's forward with one that runs the tree
depth by depth: the nodes at one depth form a batch whose initial conv window and recurrent state are
gathered from their parents' (the root's from the committed state). Per-node states are kept aside; the
committed state changes only at commit, to the state after the last accepted node. Prompts (chains) run
through the chunked kernel from the committed state, which also sidesteps transformers versions whose
multi-token cached forward restarts the recurrence.

Kernels: flash-linear-attention's gated-delta-rule kernels on CUDA when installed (the `gpu` extra),
otherwise transformers' pure-torch implementations, which are the CPU reference.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

logger = logging.getLogger(__name__)


def is_hybrid_config(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or [])


@dataclass
class GDNKernels:
    """The delta-rule functions in use: fla's on CUDA when importable, else transformers' torch ones."""

    chunk: object
    recurrent: object
    name: str

    @staticmethod
    def select(modeling_module, device: torch.device) -> GDNKernels:
        if device.type == "cuda":
            try:
                fla_ops = importlib.import_module("fla.ops.gated_delta_rule")
                return GDNKernels(fla_ops.chunk_gated_delta_rule, fla_ops.fused_recurrent_gated_delta_rule, "fla")
            except ImportError:
                pass
        # transformers wraps its torch functions to dispatch to fla when installed; unwrap for the reference.
        return GDNKernels(inspect.unwrap(modeling_module.torch_chunk_gated_delta_rule),
                          inspect.unwrap(modeling_module.torch_recurrent_gated_delta_rule), "torch")


class AttentionKV(DynamicCache):
    """transformers' cache for the attention layers only; its length is that of the first attention layer."""

    def __init__(self, first_attention_layer: int) -> None:
        super().__init__()
        self.first_attention_layer = first_attention_layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx or self.first_attention_layer)


@dataclass
class HybridCache:
    """Attention K/V plus our own committed Gated DeltaNet states per layer (conv window, recurrent state)."""

    kv: AttentionKV
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # [1, conv_dim, kernel - 1]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # [1, heads_v, d_k, d_v] float32
    node_conv: dict[int, torch.Tensor] = field(default_factory=dict)  # per tree node, from the last verify
    node_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)

    def get_seq_length(self) -> int:
        return self.kv.get_seq_length()


class TreeGDN:
    """Routes every Gated DeltaNet layer of a model through tree-aware (or chain) recurrence."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.layers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
        modeling = importlib.import_module(type(self.layers[0]).__module__)
        self.kernels = GDNKernels.select(modeling, device)
        logger.info("Gated DeltaNet kernels: %s (%d recurrent layers)", self.kernels.name, len(self.layers))
        self.cache: HybridCache | None = None
        self.parents: list[int] | None = None  # None: the new tokens are a chain after the committed state
        # Per depth: (its nodes, their parents); the root's parents are None (it starts from the committed state).
        self.levels: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for module in self.layers:
            module.forward = types.MethodType(self._make_forward(), module)

    def run(self, cache: HybridCache, parents: list[int] | None) -> TreeGDN:
        """Set what the next model forward verifies: a tree (parent per node, -1 = root) or a chain."""
        self.cache, self.parents = cache, parents
        self.levels = []
        if parents is not None:
            depth = [0] * len(parents)
            for node in range(1, len(parents)):
                depth[node] = depth[parents[node]] + 1
            by_depth: dict[int, list[int]] = {}
            for node, d in enumerate(depth):
                by_depth.setdefault(d, []).append(node)
            device = next(self.layers[0].parameters()).device
            self.levels = [(torch.tensor(nodes, device=device),
                            torch.tensor([parents[n] for n in nodes], device=device) if d else None)
                           for d, nodes in sorted(by_depth.items())]
        return self

    def _make_forward(self):
        runner = self

        def forward(module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return runner._forward(module, hidden_states)

        return forward

    def _forward(self, module, x: torch.Tensor) -> torch.Tensor:
        qkv, z, b, a = project(module, x[0])
        beta = b.sigmoid()
        g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        run = self._chain if self.parents is None else self._tree
        out = run(module, qkv, g, beta)
        out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(out.reshape(1, x.shape[1], -1))

    def _committed(self, module) -> tuple[torch.Tensor, torch.Tensor]:
        cache, layer = self.cache, module.layer_idx
        if layer not in cache.conv:
            weight = module.conv1d.weight
            cache.conv[layer] = weight.new_zeros(1, module.conv_dim, module.conv_kernel_size - 1)
            cache.recurrent[layer] = torch.zeros(1, module.num_v_heads, module.head_k_dim, module.head_v_dim,
                                                 dtype=torch.float32, device=weight.device)
        return cache.conv[layer], cache.recurrent[layer]

    def _chain(self, module, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """Tokens that follow each other (a prompt): chunked kernel from the committed state, then commit."""
        conv_state, state = self._committed(module)
        window = torch.cat([conv_state, qkv.T[None]], dim=-1)  # [1, C, K-1+T]
        u = F.silu(F.conv1d(window, module.conv1d.weight, module.conv1d.bias, groups=module.conv_dim))
        q, k, v = split_heads(module, u[0].T)
        out, final = self.kernels.chunk(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        self.cache.conv[module.layer_idx] = window[:, :, window.shape[-1] - conv_state.shape[-1]:].clone()
        self.cache.recurrent[module.layer_idx] = final.float()
        return out[0]

    def _tree(self, module, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """Depth by depth: each node starts from its parent's conv window and recurrent state."""
        conv_state, state = self._committed(module)
        n = qkv.shape[0]
        node_conv = conv_state.new_empty(n, *conv_state.shape[1:])
        node_state = state.new_empty(n, *state.shape[1:])
        out = qkv.new_empty(n, module.num_v_heads, module.head_v_dim)
        weight = module.conv1d.weight[:, 0]  # [C, K]
        for nodes, par in self.levels:
            if par is None:  # the root: from the committed state
                conv0, state0 = conv_state, state
            else:
                conv0, state0 = node_conv[par], node_state[par]
            window = torch.cat([conv0, qkv[nodes][:, :, None]], dim=-1)  # [m, C, K]
            node_conv[nodes] = window[:, :, 1:]
            u = (window * weight).sum(-1)
            if module.conv1d.bias is not None:
                u = u + module.conv1d.bias
            q, k, v = split_heads(module, F.silu(u))
            o, s = self.kernels.recurrent(q[:, None], k[:, None], v[:, None], g=g[nodes][:, None],
                                          beta=beta[nodes][:, None], initial_state=state0.contiguous(),
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
            out[nodes] = o[:, 0]
            node_state[nodes] = s.float()
        self.cache.node_conv[module.layer_idx] = node_conv
        self.cache.node_recurrent[module.layer_idx] = node_state
        return out

    @staticmethod
    def commit(cache: HybridCache, node: int) -> None:
        """The state after `node` (the last accepted one) becomes every layer's committed state."""
        for layer, conv in cache.node_conv.items():
            cache.conv[layer] = conv[node:node + 1].clone()
            cache.recurrent[layer] = cache.node_recurrent[layer][node:node + 1].clone()
        cache.node_conv.clear()
        cache.node_recurrent.clear()


def project(module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows x [N, H] -> conv input [N, conv_dim], gate z [N, heads_v, d_v], b and a [N, heads_v].

    Qwen3.5/3.6 keep separate projections; Qwen3-Next fuses them (in_proj_qkvz, in_proj_ba).
    """
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None]))
        qkv = torch.cat([t.reshape(t.shape[1], -1) for t in (q, k, v)], dim=-1)
        return qkv, z[0], b[0], a[0]
    z = module.in_proj_z(x).reshape(x.shape[0], -1, module.head_v_dim)
    return module.in_proj_qkv(x), z, module.in_proj_b(x), module.in_proj_a(x)


def split_heads(module, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output [N, conv_dim] -> q, k, v [N, heads_v, d].

    q and k are repeated to the value heads here: some transformers versions' torch kernels expect the
    caller to do it (grouped value attention), and the fla kernels accept either.
    """
    q, k, v = torch.split(u, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    n = u.shape[0]
    q, k = q.reshape(n, -1, module.head_k_dim), k.reshape(n, -1, module.head_k_dim)
    groups = module.num_v_heads // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    return q, k, v.reshape(n, -1, module.head_v_dim)
