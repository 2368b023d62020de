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

An FP8 target's experts (ddtree/models/fp8_target.py: Fp8Experts, e4m3 weights with one scale per output channel
or per 128 x 128 block) take the same launches with e4m3 operands (the FP8 constexpr; bf16's compiled kernels are
unchanged): the router's kernel also quantizes each row (fp8.quantize_rows: per row before channel scales, per
128-column group before blocks), gate/up reads those, and down quantizes each pair's SiLU · up row as it reads it
(per row: its largest magnitude first; per group: each group's as it reaches it). Each product is computed as the
reference's (Fp8Experts runs gemm.fp8_linear per expert) is by the few-row GEMM at an AR step's rows: its K tiles,
its K splits' partial sums added in order, group and block scales per K tile, channel and row scales after the
sums (gemm.fp8_tile, gemm.fp8_scaled), so a pair's output has the reference's bits wherever SiLU's has. They take any
number of rows, MAX_PAIRS pairs at a time; their PyTorch steps are the fixed loop over gemm.fp8_linear.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.fp8 import FP8, Fp8Weight, activation_group
from ddtree.kernels.gemm import blocks_supported, fp8_linear, fp8_supported, launch_config, linear, rows_of
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
    """A sparse block: router [E, H], stacked gate/up [E, 2I, H] and down [E, H, I] weights (in the model's dtype,
    or fp8 with their scales: an FP8 target's), and (Qwen3.5-MoE, Qwen3-Next) a shared expert whose output,
    scaled by a sigmoid gate, every row adds."""

    router: torch.Tensor
    gate_up: torch.Tensor | Fp8Weight
    down: torch.Tensor | Fp8Weight
    top_k: int
    renormalize: bool  # the k picked probabilities rescaled to sum to one
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None  # the shared expert, a function of the rows
    shared_gate: torch.Tensor | None = None  # [1, H]

    @classmethod
    def of(cls, mlp: nn.Module, shared: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Experts:
        """The block `mlp`; `shared` runs its shared expert, which a block that has one must be given. fp8 experts
        (ddtree.models.fp8_target.Fp8Experts) hand over their weights with `stacked()`."""
        if hasattr(mlp, "shared_expert") != (shared is not None):
            raise ValueError("a sparse block's shared expert and the function given to run it must come together")
        if hasattr(mlp.experts, "stacked"):
            gate_up, down = mlp.experts.stacked()
        else:
            gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
            grouped_works(gate_up.device, gate_up.dtype)  # probe now, not first inside a graph capture
        return cls(mlp.gate.weight, gate_up, down, mlp.gate.top_k,
                   bool(getattr(mlp.gate, "norm_topk_prob", True)),  # (Qwen3.5-MoE's router always rescales)
                   shared, mlp.shared_expert_gate.weight if shared is not None else None)

    @property
    def fp8(self) -> bool:
        """Whether the experts' weights are fp8 (an FP8 target's): the kernels' FP8 form, or fp8_linear."""
        return isinstance(self.gate_up, Fp8Weight)

    def __call__(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for normed rows h [n, H] (`logits`: the router's, where already computed)."""
        routed = self.routed(h, logits)
        if self.shared is None:
            return routed
        return routed + torch.sigmoid(linear(h, self.shared_gate)) * self.shared(h)

    def routed(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The picked experts' weighted sum for normed rows h [n, H]. fp8 experts take the kernels at any row count,
        MAX_PAIRS pairs at a time (each row's output is its own: the same bits in any chunk), as their PyTorch
        steps are a loop over every expert."""
        if not self.kernels_take(h):
            return self.routed_by_torch(h, logits)
        rows = MAX_PAIRS // self.top_k
        if h.shape[0] <= rows:
            return self.routed_by_kernels(h, logits)
        return torch.cat([self.routed_by_kernels(h[i:i + rows], None if logits is None else logits[i:i + rows])
                          for i in range(0, h.shape[0], rows)])

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
        widths that whole 16-wide K tiles cover. fp8 experts: any number of rows (`routed`), where the reference's
        products (Fp8Experts: gemm.fp8_linear) take the fp8 GEMM, whose K tiles and sums the kernels repeat."""
        if self.fp8:
            weights = (self.gate_up, self.down)
            return (fp8_supported(h) and self.down.shape[2] % 64 == 0 and h.is_contiguous()
                    and all(blocks_supported(w[0]) and w.data.is_contiguous() and w.scale.is_contiguous()
                            for w in weights))
        return (triton is not None and h.shape[0] * self.top_k <= MAX_PAIRS and h.shape[1] % 16 == 0
                and self.down.shape[2] % 16 == 0 and h.is_contiguous() and self.gate_up.is_contiguous()
                and self.down.is_contiguous() and triton_works(h.device))

    def routed_by_kernels(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """`routed` in six launches, five for one row, one fewer with the router's `logits` given (see the
        module's docstring). fp8 experts: the router's kernel also quantizes each row for gate/up, and down's
        kernel quantizes the SiLU · up rows it reads (`fp8_operands`)."""
        n, hidden = h.shape
        k, experts = self.top_k, self.router.shape[0]
        inter = self.down.shape[2]
        logits = linear(h, self.router) if logits is None else logits
        weights = torch.empty((n, k), dtype=h.dtype, device=h.device)
        picks = torch.empty((n, k), dtype=torch.int32, device=h.device)
        x, x_scale, group = h, h, None  # (the scales unread in bf16)
        if self.fp8:  # gate/up's rows, quantized in its weight's scheme
            group = activation_group(self.gate_up)
            x = torch.empty(h.shape, dtype=FP8, device=h.device)
            x_scale = torch.empty((n, hidden // group) if group else n, device=h.device)
        _route_kernel[(n,)](logits, weights, picks, h, x, x_scale, experts, hidden, logits.stride(0), TOP_K=k,
                            BLOCK_E=triton.next_power_of_2(experts), RENORMALIZE=self.renormalize, FP8=self.fp8,
                            BLOCK_H=triton.next_power_of_2(hidden) if self.fp8 else 1, GROUP=group or 0)
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
        up_weight, up_scale, up_strides, up_k = fp8_operands(self.gate_up)

        def up(tiles: dict[str, int]) -> None:
            _up_kernel[(runs, triton.cdiv(inter, tiles["block_n"]))](
                x, up_weight, owners, order, act, x_scale, up_scale, inter, up_weight.stride(0), *up_strides,
                K=hidden, BLOCK_N=tiles["block_n"], num_stages=tiles["num_stages"], **up_k, **common)

        out = torch.empty((pairs, hidden), dtype=h.dtype, device=h.device)
        down_weight, down_scale, down_strides, down_k = fp8_operands(self.down)

        def down(tiles: dict[str, int]) -> None:
            _down_kernel[(runs, triton.cdiv(hidden, tiles["block_n"]))](
                act, down_weight, owners, order, out, down_scale, hidden, down_weight.stride(0), *down_strides,
                K=inter, BLOCK_N=tiles["block_n"], num_stages=tiles["num_stages"], **down_k, **common)

        # the tuned tiles fit an H200 in either dtype and a consumer GPU (about 100 KB a block) in bf16 and fp8; in
        # float32 gate/up's take 144 KB (compiled for sm_86 and sm_90: benchmarks/kernel_resources.py)
        launch_fitting(up, UP_CONFIG, ("block_n", 16), ("moe up", h.dtype, h.device, up_k["BLOCK_K"], self.fp8))
        launch_fitting(down, DOWN_CONFIG, ("block_n", 16), ("moe down", h.dtype, h.device, down_k["BLOCK_K"],
                                                              self.fp8))
        total = torch.empty_like(h)
        _combine_kernel[(n, triton.cdiv(hidden, 256))](out, weights, total, hidden, TOP_K=k, BLOCK=256)
        return total


# From benchmarks/moe_tune.py on an H200 (Qwen3-30B-A3B's widths): columns per program and pipeline depth (bf16;
# fp8 experts take them untuned).
UP_CONFIG = dict(block_n=64, num_stages=3)
DOWN_CONFIG = dict(block_n=64, num_stages=3)


def _block_k(k: int) -> int:
    """The widest K step (up to 128) that divides k (a multiple of 16)."""
    return next(b for b in (128, 64, 32, 16) if k % b == 0)


def k_loop(n: int, k: int, fp8: bool = False, block: tuple[int, int] | None = None) -> dict[str, int | bool]:
    """The K loop's constexprs of an expert kernel over weights [E, n, k]. fp8: the K tile and K slices
    gemm.launch_config gives one expert's weight, so that each pair's float32 sums are the few-row GEMM's at an
    AR step's rows (the reference's, Fp8Experts: bit for bit where the tensor cores' tile products are), with one
    scale per row (channel: BLOCKS False) or per `block` of SCALE_ROWS x SCALE_COLS."""
    if not fp8:
        return dict(BLOCK_K=_block_k(k), SPAN=k, FP8=False, BLOCKS=False, SCALE_ROWS=1, SCALE_COLS=1)
    cfg = launch_config(n, k, fp8=True, scale_block=block[1] if block else None)
    rows, cols = block or (1, 1)
    return dict(BLOCK_K=cfg["block_k"], SPAN=k // cfg["split_k"], FP8=True, BLOCKS=block is not None,
                SCALE_ROWS=rows, SCALE_COLS=cols)


def fp8_operands(weight: torch.Tensor | Fp8Weight
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], dict[str, int | bool]]:
    """A stacked weight [E, N, K] as an expert kernel reads it: (values, scales, the scales' expert and row strides,
    `k_loop`'s constexprs); in the model's dtype the weight stands in for the unread scales."""
    if not isinstance(weight, Fp8Weight):
        return weight, weight, (0, 0), k_loop(*weight.shape[1:])
    return (weight.data, weight.scale, (weight.scale.stride(0), weight.scale.stride(1)),
            k_loop(*weight.shape[1:], fp8=True, block=weight.block))


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


def grouped(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, offsets: torch.Tensor,
            owners: torch.Tensor) -> torch.Tensor:
    """Rows x [P, K] sorted by expert times their expert's weight [E, N, K]^T -> [P, N]; `offsets` [E] (int32)
    ends each expert's run of rows, `owners` [P] names each row's expert. An fp8 weight: x quantized in its scheme
    (fp8.activation_group), and each expert's product the reference's (Fp8Experts: gemm.fp8_linear), in the fixed
    loop."""
    if isinstance(weight, Fp8Weight):
        rows = rows_of(x, activation_group(weight))

        def product(expert: int) -> torch.Tensor:
            return fp8_linear(rows, weight[expert])
    elif grouped_works(x.device, x.dtype):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    else:
        def product(expert: int) -> torch.Tensor:
            return F.linear(x, weight[expert])
    out = x.new_zeros((x.shape[0], weight.shape[1]))
    for expert in range(weight.shape[0]):  # fixed shapes: every row through every expert, each keeps its own
        out = torch.where((owners == expert)[:, None], product(expert), out)
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
    from ddtree.kernels.gemm import fp8_scaled, fp8_tile, group_scales, row_scales
    from ddtree.kernels.rows import e4m3_scale, store_e4m3, to_e4m3

    @triton.jit
    def _route_kernel(Logits, Weights, Picks, X, XQ, XS, E, H, stride_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      RENORMALIZE: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr):
        """One row's picks, as `route` makes them: softmax in float32, the TOP_K most probable (the lowest id
        among equals), optionally rescaled to sum to one, rounded to the weights' dtype, in ascending id. FP8: the
        row X [H] also goes to XQ and XS quantized (fp8.quantize_rows, per row or per GROUP columns) for the fp8
        experts' gate/up."""
        row = tl.program_id(0)
        if FP8:
            r = row + tl.zeros((1,), tl.int32)  # this row as a tile of one
            cols = tl.arange(0, BLOCK_H)
            ok = (cols < H)[None, :]
            x = tl.load(X + r[:, None] * H + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            store_e4m3(XQ, XS, x, r, cols, ok, row + 1, H, 1, BLOCK_H, GROUP)
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
    def _slices(total, part, k, BLOCK_K: tl.constexpr, SPAN: tl.constexpr):
        """(total, part) after K tile k: at the end of each SPAN-wide K slice its float32 sum `part` is added to
        `total` and starts again, the order in which the few-row GEMM adds its K splits' partial sums."""
        last = (k + BLOCK_K) % SPAN == 0
        return tl.where(last, total + part, total), tl.where(last, 0.0, part)

    @triton.jit
    def _up_kernel(X, W, Owners, Order, Act, XS, WS, N, stride_we, stride_se, stride_s, K: tl.constexpr,
                   PAIRS: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BY_EXPERT: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, SORTED: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SPAN: tl.constexpr, FP8: tl.constexpr,
                   BLOCKS: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr):
        """Columns pid_n * BLOCK_N.. of SiLU(gate) * up for every pair of this program's expert: W [E, 2N, K]
        holds gate's N rows, then up's. Each product is rounded, then SiLU, then the product, as in torch.
        Order lists the pairs by expert (SORTED: the pairs are in that order already).
        FP8: e4m3 rows X with their scales XS and weights with scales WS (expert stride stride_se), as the few-row
        GEMM multiplies them (`fp8_operands`): K tiles in SPAN-wide slices (`_slices`), each tile's product
        scaled by its rows' SCALE_COLS-column group scales (XS [rows, K / SCALE_COLS]) and its SCALE_ROWS x
        SCALE_COLS block's scale (BLOCKS; row stride stride_s), else the sums by their row's and channel's
        scales."""
        expert, start, end = _run(Owners, PAIRS, EXPERTS, BY_EXPERT, BLOCK_P)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        col_ok = rn < N
        w_gate = W + expert.to(tl.int64) * stride_we + rn[:, None] * K + rk[None, :]
        w_up = w_gate + N * K
        s_gate = WS + expert.to(tl.int64) * stride_se + (rn // SCALE_ROWS) * stride_s
        s_up = WS + expert.to(tl.int64) * stride_se + ((rn + N) // SCALE_ROWS) * stride_s
        for first in range(start, end, BLOCK_M):
            rm = first + tl.arange(0, BLOCK_M)
            row_ok = rm < end
            pairs = rm if SORTED else tl.load(Order + rm, mask=row_ok, other=0)
            x_ptrs = X + (pairs // TOP_K)[None, :] * K + rk[:, None]
            gate = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            if FP8:
                g_ptrs = XS + (pairs // TOP_K) * (K // SCALE_COLS)  # the rows' group scales (BLOCKS)
                gate_part = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                up_part = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                for k in range(0, K, BLOCK_K):
                    x = tl.load(x_ptrs + k, mask=row_ok[None, :], other=0.0)
                    x_scale = group_scales(g_ptrs + k // SCALE_COLS, row_ok, BLOCKS)
                    gate_part = fp8_tile(gate_part, tl.load(w_gate + k, mask=col_ok[:, None], other=0.0), x,
                                         s_gate + k // SCALE_COLS, col_ok, x_scale, BLOCKS)
                    up_part = fp8_tile(up_part, tl.load(w_up + k, mask=col_ok[:, None], other=0.0), x,
                                       s_up + k // SCALE_COLS, col_ok, x_scale, BLOCKS)
                    gate, gate_part = _slices(gate, gate_part, k, BLOCK_K, SPAN)
                    up, up_part = _slices(up, up_part, k, BLOCK_K, SPAN)
                x_scale = row_scales(XS + pairs // TOP_K, row_ok, BLOCKS)
                gate = fp8_scaled(gate, x_scale, s_gate, col_ok, BLOCKS)
                up = fp8_scaled(up, x_scale, s_up, col_ok, BLOCKS)
            else:
                for k in range(0, K, BLOCK_K):
                    x = tl.load(x_ptrs + k, mask=row_ok[None, :], other=0.0)
                    gate = tl.dot(tl.load(w_gate + k, mask=col_ok[:, None], other=0.0), x, gate,
                                  input_precision=PRECISION)
                    up = tl.dot(tl.load(w_up + k, mask=col_ok[:, None], other=0.0), x, up,
                                input_precision=PRECISION)
            dtype = Act.dtype.element_ty
            gate = gate.to(dtype).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
            tl.store(Act + pairs[None, :] * N + rn[:, None], act, mask=col_ok[:, None] & row_ok[None, :])

    @triton.jit
    def _down_kernel(A, W, Owners, Order, Out, WS, N, stride_we, stride_se, stride_s, K: tl.constexpr,
                     PAIRS: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BY_EXPERT: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, SORTED: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SPAN: tl.constexpr, FP8: tl.constexpr,
                     BLOCKS: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr):
        """Columns pid_n * BLOCK_N.. of every pair's down projection by its expert's W [E, N, K], rounded. FP8:
        each pair's row of A quantized as fp8.quantize_rows does, then the product as in _up_kernel: with BLOCKS per
        SCALE_COLS-column group (each group's largest magnitude as its first K tile is reached), else per row (its
        largest magnitude first, over all of K)."""
        expert, start, end = _run(Owners, PAIRS, EXPERTS, BY_EXPERT, BLOCK_P)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        col_ok = rn < N
        w_ptrs = W + expert.to(tl.int64) * stride_we + rn[:, None] * K + rk[None, :]
        s_ptrs = WS + expert.to(tl.int64) * stride_se + (rn // SCALE_ROWS) * stride_s
        for first in range(start, end, BLOCK_M):
            rm = first + tl.arange(0, BLOCK_M)
            row_ok = rm < end
            pairs = rm if SORTED else tl.load(Order + rm, mask=row_ok, other=0)
            a_ptrs = A + pairs[None, :] * K + rk[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            if FP8:
                part = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                if BLOCKS:
                    group_ptrs = A + pairs[None, :] * K + tl.arange(0, SCALE_COLS)[:, None]
                    for k in range(0, K, BLOCK_K):
                        group = tl.load(group_ptrs + k // SCALE_COLS * SCALE_COLS, mask=row_ok[None, :],
                                        other=0.0).to(tl.float32)
                        a_scale = e4m3_scale(tl.max(tl.abs(group), axis=0))
                        if BLOCK_K == SCALE_COLS:
                            a = group
                        else:
                            a = tl.load(a_ptrs + k, mask=row_ok[None, :], other=0.0).to(tl.float32)
                        part = fp8_tile(part, tl.load(w_ptrs + k, mask=col_ok[:, None], other=0.0),
                                        to_e4m3(a, a_scale[None, :]), s_ptrs + k // SCALE_COLS, col_ok, a_scale, True)
                        acc, part = _slices(acc, part, k, BLOCK_K, SPAN)
                else:
                    largest = tl.zeros((BLOCK_M,), tl.float32)
                    for k in range(0, K, BLOCK_K):
                        a = tl.load(a_ptrs + k, mask=row_ok[None, :], other=0.0).to(tl.float32)
                        largest = tl.maximum(largest, tl.max(tl.abs(a), axis=0))
                    a_scale = e4m3_scale(largest)
                    for k in range(0, K, BLOCK_K):
                        a = to_e4m3(tl.load(a_ptrs + k, mask=row_ok[None, :], other=0.0).to(tl.float32),
                                    a_scale[None, :])
                        part = fp8_tile(part, tl.load(w_ptrs + k, mask=col_ok[:, None], other=0.0), a,
                                        s_ptrs + k // SCALE_COLS, col_ok, a_scale, False)
                        acc, part = _slices(acc, part, k, BLOCK_K, SPAN)
                    acc = fp8_scaled(acc, a_scale, s_ptrs, col_ok, False)
            else:
                for k in range(0, K, BLOCK_K):
                    acc = tl.dot(tl.load(w_ptrs + k, mask=col_ok[:, None], other=0.0),
                                 tl.load(a_ptrs + k, mask=row_ok[None, :], other=0.0), acc,
                                 input_precision=PRECISION)
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
