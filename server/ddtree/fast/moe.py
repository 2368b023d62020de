"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) on the fast path, in fixed shapes that a CUDA
graph can replay.

transformers runs a sparse block as a loop over the experts that some token picked (`nonzero`, then one
GEMM per expert): shapes that depend on the routing, so it can be neither captured nor replayed. Here the
n rows' n * k (row, expert) pairs are sorted by expert on the device, the offsets of each expert's run are a
cumulative count, and each of the two projections is one grouped GEMM over the runs (`torch._grouped_mm`:
an expert no pair picked costs nothing, so a step reads the weights of the picked experts only). Then the
pairs go back to their rows, and each row adds its experts' outputs, weighted, in the order the reference
adds them (ascending expert id, rounding after every add): in float32 the reference's sums exactly.

Where the grouped GEMM is missing, or cannot be captured into a CUDA graph on this build (it needs the
offsets on the host), a fixed loop over every expert stands in: every pair through every expert, each
keeping its own expert's rows. That costs E GEMMs, so it is a fallback for tests and odd builds, not a
fast path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.fast.gemm import linear

_GROUPED: dict[tuple[torch.device, torch.dtype], bool] = {}


@dataclass(frozen=True)
class Experts:
    """A sparse block: router [E, H], stacked gate/up [E, 2I, H] and down [E, H, I] weights, and (Qwen3.5-MoE,
    Qwen3-Next) a shared expert whose output, scaled by a sigmoid gate, every row adds."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    renormalize: bool  # the k picked probabilities rescaled to sum to one
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None  # the shared expert, a function of the rows
    shared_gate: torch.Tensor | None = None  # [1, H]

    @classmethod
    def of(cls, mlp: nn.Module, shared: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Experts:
        """The block `mlp`; `shared` runs its shared expert, which a block that has one must be given."""
        if hasattr(mlp, "shared_expert") != (shared is not None):
            raise ValueError("a sparse block's shared expert and the function given to run it must come together")
        weights = mlp.experts.gate_up_proj
        grouped_works(weights.device, weights.dtype)  # probe now, not first inside a graph capture
        return cls(mlp.gate.weight, weights, mlp.experts.down_proj, mlp.gate.top_k,
                   bool(getattr(mlp.gate, "norm_topk_prob", True)),  # (Qwen3.5-MoE's router always rescales)
                   shared, mlp.shared_expert_gate.weight if shared is not None else None)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The block's output for normed rows h [n, H]."""
        routed = self.routed(h)
        if self.shared is None:
            return routed
        return routed + torch.sigmoid(linear(h, self.shared_gate)) * self.shared(h)

    def routed(self, h: torch.Tensor) -> torch.Tensor:
        """The picked experts' weighted sum for normed rows h [n, H]."""
        n, k = h.shape[0], self.top_k
        weights, experts = route(linear(h, self.router), k, self.renormalize)
        pairs = experts.flatten()  # row-major: pair r * k + j is row r's j-th expert (ascending ids)
        order = pairs.argsort(stable=True)  # pairs by expert, each expert's rows in row order
        ids = torch.arange(self.router.shape[0], device=h.device)
        offsets = (pairs[:, None] == ids[None, :]).sum(0).cumsum(0).to(torch.int32)  # end of each expert's run
        owners = pairs.index_select(0, order)
        gate, up = grouped(h.index_select(0, order // k), self.gate_up, offsets, owners).chunk(2, dim=-1)
        out = grouped(F.silu(gate) * up, self.down, offsets, owners)
        out = torch.empty_like(out).index_copy_(0, order, out).view(n, k, -1)  # back to (row, j) order
        total = torch.zeros_like(out[:, 0])
        for j in range(k):  # the reference's index_add_ order: ascending expert id, rounding each time
            total = total + out[:, j] * weights[:, j, None]
        return total


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k experts as Qwen3-MoE's router picks them (softmax in float32, top-k, optional
    renormalisation, rounded to the logits' dtype): (weights [n, k], expert ids [n, k]), each row's pairs
    reordered by ascending expert id."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    experts, position = experts.sort(dim=-1)
    return weights.gather(-1, position).to(logits.dtype), experts


def grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
    """Rows x [P, K] sorted by expert times their expert's weight [E, N, K]^T -> [P, N]; `offsets` [E] (int32)
    ends each expert's run of rows, `owners` [P] names each row's expert."""
    if grouped_works(x.device, x.dtype):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_zeros((x.shape[0], weight.shape[1]))
    for expert in range(weight.shape[0]):  # fixed shapes: every row through every expert, each keeps its own
        out = torch.where((owners == expert)[:, None], F.linear(x, weight[expert]), out)
    return out


def grouped_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs on `device` in `dtype` and, on CUDA, can be captured into a graph;
    checked once on tiny inputs against per-expert products (an empty run included)."""
    key = (device, dtype)
    if key not in _GROUPED:
        try:
            _GROUPED[key] = _probe(device, dtype)
        except Exception as exc:  # an op missing from this build, an unsupported dtype or layout, a sync
            print(f"ddtree fast path: grouped GEMM unavailable for {dtype} on {device.type} "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                  "experts run as a loop over every expert", file=sys.stderr)
            _GROUPED[key] = False
    return _GROUPED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen).to(device, dtype)
    weight = torch.randn(3, 32, 16, generator=gen).to(device, dtype)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32, device=device)
    want = torch.cat([F.linear(x[:2], weight[0]), F.linear(x[2:], weight[2])])

    def run() -> torch.Tensor:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    got = run()
    if device.type == "cuda":  # it must also replay from a graph, as the rounds do
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                got = run()
        graph.replay()
        torch.cuda.synchronize(device)
    return torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)
