"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) on the fast path, in fixed shapes that a CUDA
graph can replay.

transformers runs a sparse block as a loop over the experts that some token picked (`nonzero`, then one
GEMM per expert): shapes that depend on the routing, so it can be neither captured nor replayed. Here the
n rows' n * k (row, expert) pairs are sorted by expert on the device, the offsets of each expert's run are a
cumulative count, and each of the two projections is one grouped GEMM over the runs (`torch._grouped_mm`:
an expert no pair picked costs nothing, so a step reads the weights of the picked experts only). Then the
pairs go back to their rows, and each row adds its experts' outputs, weighted, in the order the reference
adds them (ascending expert id, rounding after every add): in float32 the reference's sums exactly.

On CUDA (and in Triton's interpreter, for the CPU tests) up to MAX_PAIRS pairs take Triton instead, in six
kernels a layer where the PyTorch steps take about forty (at batch 1 each costs more than its bytes):
the router's GEMM; one program per row for softmax, top-k, renormalisation and the picks in ascending
expert id (`_route_kernel`); one sort of the pairs by expert (not for one row: its picks are in order);
gate/up with SiLU · up, and down, each one launch over the runs of pairs that share an expert
(`_up_kernel`, `_down_kernel`: a program streams one column tile of its expert's weight once for all of
that expert's pairs; one program per expert, or per pair when there are fewer pairs than experts, so an
AR step launches no idle programs); the weighted sum in the reference's order (`_combine_kernel`). Each
rounds where transformers' loop rounds. In an AR step the router is the GEMV that also norms the row (the
fast path's one-row layers: `gemv.norm_gemv`), and four launches follow it.

Where the grouped GEMM is missing, or cannot be captured into a CUDA graph on this build (it needs the
offsets on the host), a fixed loop over every expert stands in: every pair through every expert, each
keeping its own expert's rows. That costs E GEMMs, so it is a fallback for tests and odd builds, not a
fast path.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.gemm import linear
from ddtree.kernels.jit import launch_fitting, triton_works

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch steps
    triton = None

MAX_PAIRS = 2048  # (row, expert) pairs the Triton kernels take (256 rows at k = 8); more take the PyTorch steps
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

    def __call__(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for normed rows h [n, H] (`logits`: the router's, where already computed)."""
        routed = self.routed(h, logits)
        if self.shared is None:
            return routed
        return routed + torch.sigmoid(linear(h, self.shared_gate)) * self.shared(h)

    def routed(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The picked experts' weighted sum for normed rows h [n, H]."""
        return self.routed_by_kernels(h, logits) if self.kernels_take(h) else self.routed_by_torch(h, logits)

    def routed_by_torch(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """`routed` in PyTorch steps around the grouped GEMM (or the fixed loop)."""
        n, k = h.shape[0], self.top_k
        weights, experts = route(linear(h, self.router) if logits is None else logits, k, self.renormalize)
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

    def kernels_take(self, h: torch.Tensor) -> bool:
        """Whether the Triton kernels run these rows: on a device where Triton runs, up to MAX_PAIRS pairs,
        widths that whole 16-wide K tiles cover."""
        return (triton is not None and h.shape[0] * self.top_k <= MAX_PAIRS and h.shape[1] % 16 == 0
                and self.down.shape[2] % 16 == 0 and h.is_contiguous() and self.gate_up.is_contiguous()
                and self.down.is_contiguous() and triton_works(h.device))

    def routed_by_kernels(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """`routed` in six launches, five for one row, one fewer with the router's `logits` given (see the
        module's docstring)."""
        n, hidden = h.shape
        k, experts = self.top_k, self.router.shape[0]
        inter = self.down.shape[2]
        logits = linear(h, self.router) if logits is None else logits
        weights = torch.empty((n, k), dtype=h.dtype, device=h.device)
        picks = torch.empty((n, k), dtype=torch.int32, device=h.device)
        _route_kernel[(n,)](logits, weights, picks, experts, logits.stride(0), TOP_K=k,
                            BLOCK_E=triton.next_power_of_2(experts), RENORMALIZE=self.renormalize)
        if n == 1:  # one row's picks are already in ascending expert id: no sort
            owners, order = picks.view(-1), picks.view(-1)
        else:
            owners, order = picks.flatten().sort(stable=True)  # pairs by expert, each expert's in row order
        pairs = n * k
        runs = min(experts, pairs)  # programs per column tile: one per expert, or one per pair when fewer
        common = dict(PAIRS=pairs, EXPERTS=experts, TOP_K=k, BY_EXPERT=pairs > experts,
                      BLOCK_P=triton.next_power_of_2(pairs), BLOCK_M=16, SORTED=n == 1,
                      PRECISION="ieee" if h.dtype == torch.float32 else "tf32", num_warps=4)
        act = torch.empty((pairs, inter), dtype=h.dtype, device=h.device)

        def up(tiles: dict[str, int]) -> None:
            _up_kernel[(runs, triton.cdiv(inter, tiles["block_n"]))](
                h, self.gate_up, owners, order, act, inter, self.gate_up.stride(0), K=hidden,
                BLOCK_N=tiles["block_n"], BLOCK_K=_block_k(hidden), num_stages=tiles["num_stages"], **common)

        out = torch.empty((pairs, hidden), dtype=h.dtype, device=h.device)

        def down(tiles: dict[str, int]) -> None:
            _down_kernel[(runs, triton.cdiv(hidden, tiles["block_n"]))](
                act, self.down, owners, order, out, hidden, self.down.stride(0), K=inter,
                BLOCK_N=tiles["block_n"], BLOCK_K=_block_k(inter), num_stages=tiles["num_stages"], **common)

        # the tuned tiles fit an H200 in either dtype and a consumer GPU (about 100 KB a block) in bf16; in
        # float32 gate/up's take 144 KB (compiled for sm_86 and sm_90: benchmarks/kernel_resources.py)
        launch_fitting(up, UP_CONFIG, ("block_n", 16), ("moe up", h.dtype, h.device, _block_k(hidden)))
        launch_fitting(down, DOWN_CONFIG, ("block_n", 16), ("moe down", h.dtype, h.device, _block_k(inter)))
        total = torch.empty_like(h)
        _combine_kernel[(n, triton.cdiv(hidden, 256))](out, weights, total, hidden, TOP_K=k, BLOCK=256)
        return total


# From benchmarks/moe_tune.py on an H200 (Qwen3-30B-A3B's widths): columns per program and pipeline depth.
UP_CONFIG = dict(block_n=64, num_stages=3)
DOWN_CONFIG = dict(block_n=64, num_stages=3)


def _block_k(k: int) -> int:
    """The widest K step (up to 128) that divides k (a multiple of 16)."""
    return next(b for b in (128, 64, 32, 16) if k % b == 0)


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
        with torch.cuda.stream(stream), warnings.catch_warnings():
            # a capture that raises (float32 on torch 2.11 copies from the host) closes an empty graph, whose
            # warning would only repeat grouped_works' message
            warnings.filterwarnings("ignore", "The CUDA Graph is empty")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                got = run()
        got.fill_(float("nan"))  # what the replay leaves here is what it computed
        graph.replay()
        torch.cuda.synchronize(device)
    return torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


if triton is not None:

    @triton.jit
    def _route_kernel(Logits, Weights, Picks, E, stride_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      RENORMALIZE: tl.constexpr):
        """One row's picks, as `route` makes them: softmax in float32, the TOP_K most probable (the lowest id
        among equals), optionally rescaled to sum to one, rounded to the weights' dtype, in ascending id."""
        row = tl.program_id(0)
        ids = tl.arange(0, BLOCK_E)
        valid = ids < E
        logits = tl.load(Logits + row * stride_l + ids, mask=valid, other=-float("inf")).to(tl.float32)
        exps = tl.exp(logits - tl.max(logits, axis=0))
        probs = tl.where(valid, exps / tl.sum(exps, axis=0), -1.0)
        picked = ids < 0
        left = probs
        for _ in tl.static_range(TOP_K):
            best = tl.min(tl.where(left == tl.max(left, axis=0), ids, BLOCK_E), axis=0)
            picked = picked | (ids == best)
            left = tl.where(ids == best, -2.0, left)
        weights = tl.where(picked, probs, 0.0)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=0)
        slot = row * TOP_K + tl.cumsum(picked.to(tl.int32), axis=0) - 1
        tl.store(Weights + slot, weights.to(Weights.dtype.element_ty), mask=picked)
        tl.store(Picks + slot, ids, mask=picked)

    @triton.jit
    def _run(Owners, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, BY_EXPERT: tl.constexpr, BLOCK_P: tl.constexpr):
        """This program's expert and its run [start, end) of the sorted pairs. By expert, program e takes
        expert e (an empty run if no pair picked it); by pair, program p takes the run that starts at sorted
        pair p (an empty one if p does not start a run)."""
        pid = tl.program_id(0)
        rp = tl.arange(0, BLOCK_P)
        owners = tl.load(Owners + rp, mask=rp < PAIRS, other=EXPERTS)
        expert = pid if BY_EXPERT else tl.load(Owners + pid)
        start = tl.sum((owners < expert).to(tl.int32), axis=0)
        end = tl.sum((owners <= expert).to(tl.int32), axis=0)
        if not BY_EXPERT:
            end = tl.where(start == pid, end, start)
        return expert, start, end

    @triton.jit
    def _up_kernel(X, W, Owners, Order, Act, N, stride_we, K: tl.constexpr, PAIRS: tl.constexpr,
                   EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BY_EXPERT: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_M: tl.constexpr, SORTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
        """Columns pid_n * BLOCK_N.. of SiLU(gate) * up for every pair of this program's expert: W [E, 2N, K]
        holds gate's N rows, then up's. Each product is rounded, then SiLU, then the product, as in torch.
        Order lists the pairs by expert (SORTED: the pairs are in that order already)."""
        expert, start, end = _run(Owners, PAIRS, EXPERTS, BY_EXPERT, BLOCK_P)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        col_ok = rn < N
        w_gate = W + expert.to(tl.int64) * stride_we + rn[:, None] * K + rk[None, :]
        w_up = w_gate + N * K
        for first in range(start, end, BLOCK_M):
            rm = first + tl.arange(0, BLOCK_M)
            row_ok = rm < end
            pairs = rm if SORTED else tl.load(Order + rm, mask=row_ok, other=0)
            x_ptrs = X + (pairs // TOP_K)[None, :] * K + rk[:, None]
            gate = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for k in range(0, K, BLOCK_K):
                x = tl.load(x_ptrs + k, mask=row_ok[None, :], other=0.0)
                gate = tl.dot(tl.load(w_gate + k, mask=col_ok[:, None], other=0.0), x, gate,
                              input_precision=PRECISION)
                up = tl.dot(tl.load(w_up + k, mask=col_ok[:, None], other=0.0), x, up, input_precision=PRECISION)
            dtype = Act.dtype.element_ty
            gate = gate.to(dtype).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
            tl.store(Act + pairs[None, :] * N + rn[:, None], act, mask=col_ok[:, None] & row_ok[None, :])

    @triton.jit
    def _down_kernel(A, W, Owners, Order, Out, N, stride_we, K: tl.constexpr, PAIRS: tl.constexpr,
                     EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BY_EXPERT: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_M: tl.constexpr, SORTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
        """Columns pid_n * BLOCK_N.. of every pair's down projection by its expert's W [E, N, K], rounded."""
        expert, start, end = _run(Owners, PAIRS, EXPERTS, BY_EXPERT, BLOCK_P)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        col_ok = rn < N
        w_ptrs = W + expert.to(tl.int64) * stride_we + rn[:, None] * K + rk[None, :]
        for first in range(start, end, BLOCK_M):
            rm = first + tl.arange(0, BLOCK_M)
            row_ok = rm < end
            pairs = rm if SORTED else tl.load(Order + rm, mask=row_ok, other=0)
            a_ptrs = A + pairs[None, :] * K + rk[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for k in range(0, K, BLOCK_K):
                acc = tl.dot(tl.load(w_ptrs + k, mask=col_ok[:, None], other=0.0),
                             tl.load(a_ptrs + k, mask=row_ok[None, :], other=0.0), acc, input_precision=PRECISION)
            tl.store(Out + pairs[None, :] * N + rn[:, None], acc.to(Out.dtype.element_ty),
                     mask=col_ok[:, None] & row_ok[None, :])

    @triton.jit
    def _combine_kernel(Out, Weights, Total, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        """A row's weighted sum of its experts' outputs, in ascending expert id, each product and each sum
        rounded to the dtype (transformers' index_add_ loop)."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        dtype = Total.dtype.element_ty
        total = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(TOP_K):
            weight = tl.load(Weights + row * TOP_K + j).to(tl.float32)
            out = tl.load(Out + (row * TOP_K + j) * N + cols, mask=ok, other=0.0).to(tl.float32)
            total = (total + (out * weight).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(Total + row * N + cols, total.to(dtype), mask=ok)
