"""Few-row projections (a draft block, a small tree's verify, a commit) as a Triton GEMM that reads each
weight once.

At 16-32 rows a projection is bound by its weight's bytes, but cuBLAS leaves the 4096-wide weights of an 8B
model at 2.5-3.6 TB/s. Here every program owns BLOCK_N output columns for *all* the
rows, so the weight streams through once, and the tensor-core product puts the weight on the MMA's wide
side (y^T = W x^T), so rows only pad up to 16 or 32. Narrow weights also split K over SPLIT_K programs, so
that the GPU fills; the last program of a column tile to finish sums the float32 partials in a fixed order
(deterministic, no atomics on the values) and leaves its counter at zero for the next launch.

More rows pad the product to 64 or 128 and make it compute-bound in Triton: there a kernel that pads rows to a
multiple of 8 wins, so `linear` hands those to ours on Hopper (ddtree/kernels/wgmma.py) and to cuBLAS elsewhere.

The same kernel takes fp8 projections (fp8.py; `skinny_fp8`): e4m3 weights and rows, half the bytes, on the
fp8 tensor cores, at any row count (a prompt's context rows in tiles): a quantized drafter's and an fp8
target's, whose published checkpoints scale 128 x 128 blocks (each 128-wide K step's product scaled by its
rows' 1 x 128 group scales and its blocks' scales before it is added: W8A8 block FP8).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ddtree.kernels import wgmma
from ddtree.kernels.fp8 import (
    SCALE_BLOCK,
    Fp8Weight,
    QuantizedRows,
    activation_group,
    check_rows,
    quantize_rows,
    reference_mm,
)
from ddtree.kernels.gemv import gemv
from ddtree.kernels.gemv import supported as gemv_supported
from ddtree.kernels.jit import after_previous, attempt, launch_fitting, pdl, probe, triton_works
from ddtree.kernels.rows import quantize as quantize_on_gpu

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the caller keeps F.linear
    triton = None

MAX_ROWS = 32  # measured: 65 rows run 1.2x slower than cuBLAS (compute-bound after padding to 128)
FP8_ROW_TILE = 64  # fp8 rows in one tile; more rows take several tiles (and no K splits)
ROW_GEMV_MAX_N = 8192  # narrow weights: where the GEMV beat cuBLAS at one row
LT_MAX_ROWS = 128  # measured: from 33 to 80 rows cuBLASLt is the faster; at 129 and 512 rows, no faster
_KEPT_ZEROS: dict[tuple[str, torch.device, torch.dtype], list[torch.Tensor]] = {}


_PROMPTS = threading.local()  # .active: the projections running are a prompt's (`prompt_rows`)


@contextlib.contextmanager
def prompt_rows() -> Iterator[None]:
    """Projections inside the block are a prompt's: their row counts are whatever the prompts' lengths are, so
    they take the library GEMMs rather than our Hopper GEMM, which is built for each padded row count (a build
    of a few hundred milliseconds that a request would wait for; the trees' counts are built at start-up). The
    same prompt's rows then get the same bits whenever it comes."""
    before = getattr(_PROMPTS, "active", False)
    _PROMPTS.active = True
    try:
        yield
    finally:
        _PROMPTS.active = before


def _tree_rows() -> bool:
    return not getattr(_PROMPTS, "active", False)


def linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor | Fp8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through the fastest kernel for its rows: one row of a weight up to ROW_GEMV_MAX_N wide through the
    Triton GEMV (gemv.py; on wider ones cuBLAS is as fast), every one-row projection outside the fused GEMV layers;
    up to MAX_ROWS rows through the skinny kernel above; on a Hopper GPU 33-136 half-precision rows through our
    wgmma GEMM (wgmma.py: it launches as a programmatic dependent, which cuBLASLt's kernels cannot); elsewhere
    rows up to LT_MAX_ROWS (a tree of 32-127 nodes) through cuBLASLt, which cuBLAS' heuristics do not pick there.
    An fp8 weight (a quantized drafter's, fp8.py) takes the skinny kernel on fp8 operands (`skinny_fp8`), and rows
    already quantized for it (QuantizedRows) need one."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    if bias is None and x.dim() == 2 and x.dtype == weight.dtype:
        if (x.shape[0] == 1 and weight.shape[0] <= ROW_GEMV_MAX_N and gemv_supported(weight)
                and x.stride(1) == 1 and triton_works(x.device)):
            return gemv(x, weight)[0]
        if supported(x, weight) and triton_works(x.device):
            return skinny_linear(x, weight)
        if x.shape[0] > MAX_ROWS and wgmma.supported(x, weight) and _tree_rows():
            # None where NVRTC or the driver cannot build or launch it: cuBLASLt below, from then on
            y = attempt(("wgmma", x.shape[0], *weight.shape, x.dtype, x.device), wgmma.linear, x, weight)
            if y is not None:
                return y
        if x.is_cuda and MAX_ROWS < x.shape[0] <= LT_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
            return F.linear(x, weight, _zero_bias(weight.shape[0], x))
    return F.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """fused.silu_mul(linear(x, weight)) for a SwiGLU's fused [gate; up] weight in one launch, where our Hopper
    GEMM takes `linear`'s product (33-136 half-precision rows; its epilogue computes SiLU · up with
    ddtree/kernels/rows.py's bits); None elsewhere, where the caller runs the product and then SiLU · up."""
    if not (wgmma.supported(x, weight) and weight.shape[0] % 2 == 0 and _tree_rows()):
        return None
    return attempt(("wgmma SiLU", x.shape[0], *weight.shape, x.dtype, x.device), wgmma.silu_mul_linear, x, weight)


def pair_linear(x: torch.Tensor | QuantizedRows, first: torch.Tensor | Fp8Weight,
                second: torch.Tensor | Fp8Weight) -> torch.Tensor | None:
    """[linear(x, first), linear(x, second)] side by side [M, N1 + N2] in one launch of the few-row kernel, which
    takes the second weight's rows as the columns past the first's: a DFlash draft layer's q and its k/v, whose
    weights live apart (k/v are rows of the all-layer context projection). None where that kernel does not take
    both (the caller runs two products)."""
    if triton is None or first.shape[1] != second.shape[1]:
        return None
    if isinstance(first, Fp8Weight) and isinstance(second, Fp8Weight):
        if first.block is not None or second.block is not None:
            return None  # only a drafter's channel-scaled q and k/v pair
        rows = x if isinstance(x, QuantizedRows) else rows_of(x)
        check_rows(rows, first)
        if not (fp8_supported(rows.values) and _pairable(first.data, second.data)):
            return None
        n = first.shape[0] + second.shape[0]
        return _skinny(rows.values, rows.scale, first.data, first.scale, rows.dtype,
                       launch_config(n, rows.values.shape[1], fp8=True), second=(second.data, second.scale))
    if (isinstance(x, torch.Tensor) and isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
            and supported(x, first) and supported(x, second) and triton_works(x.device)
            and _pairable(first, second)):
        n = first.shape[0] + second.shape[0]
        return _skinny(x, None, first, None, x.dtype, launch_config(n, x.shape[1]), second=(second, None))
    return None


def rows_of(x: torch.Tensor, group: int | None = None) -> QuantizedRows:
    """x [..., K] as QuantizedRows [M, K], one scale per row or per `group` columns (fp8.quantize_rows): by the GPU
    kernel where it runs (rows.py), else the reference."""
    flat = x.reshape(-1, x.shape[-1])
    values, scale = quantize_on_gpu(flat, group) if fp8_supported(flat) else quantize_rows(flat, group)
    return QuantizedRows(values, scale, x.dtype, group)


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (or rows already quantized in the weight's scheme, fp8.activation_group) @ weight^T (+ bias): the
    fp8 GPU kernels where they run, else the reference."""
    rows = x if isinstance(x, QuantizedRows) else rows_of(x, activation_group(weight))
    check_rows(rows, weight)
    if fp8_supported(rows.values) and blocks_supported(weight):
        out = skinny_fp8(rows.values, rows.scale, weight, rows.dtype)
    else:
        out = reference_mm(rows, weight)
    leading = x.values.shape[:-1] if isinstance(x, QuantizedRows) else x.shape[:-1]
    out = out.view(*leading, weight.shape[0])
    return out if bias is None else out + bias


def _pairable(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether one launch takes both weights: the same row stride, contiguous rows, and the first's rows ending on
    a column tile (64), so that no tile reads both."""
    return (first.stride(1) == second.stride(1) == 1 and first.stride(0) == second.stride(0)
            and first.shape[0] % 64 == 0 and first.dtype == second.dtype)


def _zero_bias(n: int, x: torch.Tensor) -> torch.Tensor:
    """A zero bias of n entries: given a bias, torch's addmm runs cuBLASLt (bias epilogue), not cuBLAS, and adding
    0.0 changes no value. (torch.backends.cuda.preferred_blas_library would switch every GEMM of the process,
    prompts' included, where cuBLAS is the faster.) One buffer per device and dtype serves every call."""
    return _kept_zeros("bias", n, x.dtype, x.device, least=1 << 18)[:n]


def blocks_supported(weight: Fp8Weight) -> bool:
    """Whether the kernel takes a weight's scales: per channel, or per block of whole SCALE_BLOCK-wide K tiles
    (a weight whose K ends inside a block runs the reference)."""
    return weight.block is None or (weight.block[1] == SCALE_BLOCK and weight.shape[1] % SCALE_BLOCK == 0)


def launch_config(n: int, k: int, fp8: bool = False, scale_block: int | None = None) -> dict[str, int]:
    """Column tile, K tile, K splits, warps and pipeline depth for an [n, k] weight at up to MAX_ROWS rows.

    From benchmarks/skinny_tune.py on an H200 (Qwen3-8B and its DFlash draft's widths): 64-column tiles and
    128-wide K steps throughout; K splits until ~160 programs run, and further while each still covers
    3072 or more of K (the long down and fc weights). An fp8 weight (`skinny_fp8`) takes 256-wide K steps,
    the same bytes a step: the best of benchmarks/fp8_tune.py's grid at every draft projection, with
    the same splits and depths. A block-scaled weight takes K steps of its block's width (`scale_block`, 128), so
    that each step's product has one scale per column (untuned: the lead's H200 runs will say).
    """
    block_n = 64
    widths = (scale_block,) if scale_block else (256, 128, 64) if fp8 else (128, 64)
    block_k = next(w for w in widths if k % w == 0 or w == 64)
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    while tiles * split_k * 2 <= 160 and _splits(k, 2 * split_k, block_k):
        split_k *= 2
    while tiles * split_k * 2 <= 256 and k // (2 * split_k) >= 3072 and _splits(k, 2 * split_k, block_k):
        split_k *= 2
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=3 if tiles >= 256 else 4)


def _splits(k: int, split_k: int, block_k: int) -> bool:
    """Whether K divides into `split_k` slices of whole K tiles."""
    return k % (split_k * block_k) == 0


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these rows and this weight: 2..MAX_ROWS contiguous rows, K a multiple of 64,
    the same dtype (where it runs is `linear`'s question)."""
    if x.dim() != 2 or triton is None:
        return False
    rows, k = x.shape
    return (1 < rows <= MAX_ROWS and x.stride(1) == 1 and weight.dim() == 2 and weight.stride(1) == 1
            and weight.shape[1] == k and k % 64 == 0 and weight.dtype == x.dtype)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N], for M up to 256 (more rows than MAX_ROWS run, only slower)."""
    return _skinny(x, None, weight, None, x.dtype, config or launch_config(weight.shape[0], x.shape[1]))


def skinny_fp8(values: torch.Tensor, scale: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype,
               config: dict[str, int] | None = None) -> torch.Tensor:
    """Rows quantized to e4m3 (values [M, K]; fp8.py) @ an fp8 weight^T -> [M, N] in `dtype`: the same kernel with
    fp8 operands (fp8 tensor cores: compute capability 8.9+), each K tile's product added in float32. A channel-
    scaled weight: per-row scales [M], 256-wide K tiles (the bf16 kernel's bytes a step), (row scale x channel
    scale) applied after the sum. A block-scaled one: the rows' group scales [M, K / 128] (contiguous), 128-wide K
    tiles, each tile's product times its rows' and its blocks' scales. Any number of rows: past FP8_ROW_TILE (a
    prompt's context) they run in tiles, without K splits. `config`: launch_config's keys, for tuning
    (benchmarks/fp8_tune.py)."""
    rows, k = values.shape
    want = (rows, k // weight.block[1]) if weight.block else (rows,)
    if scale.shape != want or not scale.is_contiguous():
        raise ValueError(f"row scales {list(scale.shape)} for a weight with {weight.block or 'channel'} scales: "
                         f"{list(want)}, contiguous, wanted")
    cfg = config or launch_config(weight.shape[0], k, fp8=True, scale_block=weight.block[1] if weight.block else None)
    return _skinny(values, scale, weight.data, weight.scale, dtype, cfg, blocks=weight.block)


def _skinny(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, w_scale: torch.Tensor | None,
            dtype: torch.dtype, cfg: dict[str, int],
            second: tuple[torch.Tensor, torch.Tensor | None] | None = None,
            blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """One launch of _skinny_kernel: half-precision or float32 operands, or (with the scales) fp8 ones; with
    `second` (a weight and its scales, `pair_linear`) its rows as further columns; `blocks`: the fp8 weight's
    scale block (rows, columns), None for channel scales."""
    rows, k = x.shape
    first_n = weight.shape[0]
    after, after_scale = second if second is not None else (weight, w_scale)
    n = first_n + (after.shape[0] if second is not None else 0)
    fp8 = x_scale is not None
    block_m = max(16, triton.next_power_of_2(rows)) if not fp8 or rows <= FP8_ROW_TILE else FP8_ROW_TILE
    row_tiles = triton.cdiv(rows, block_m)
    split_k = cfg["split_k"] if row_tiles == 1 else 1
    tiles = triton.cdiv(n, cfg["block_n"])
    y = torch.empty((rows, n), dtype=dtype, device=x.device)
    partials = torch.empty((split_k, rows, n) if split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    counters = _counters(x.device, tiles)
    dependent = pdl(x.device)
    scales = (x_scale, w_scale, after_scale) if fp8 else (y, y, y)  # unread without FP8

    def launch(fit: dict[str, int]) -> None:
        _skinny_kernel[(tiles, split_k, row_tiles)](
            x, scales[0], weight, scales[1], after, scales[2], y, partials, counters, rows, first_n, n, x.stride(0),
            weight.stride(0), w_scale.stride(0) if blocks else 0, K=k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=cfg["block_n"],
            BLOCK_K=fit["block_k"], SPLIT_K=split_k, FP8=fp8, SCALE_ROWS=blocks[0] if blocks else 0,
            SCALE_COLS=blocks[1] if blocks else 1, PDL=dependent, num_warps=cfg["num_warps"],
            num_stages=fit["num_stages"], launch_pdl=dependent)

    # float32 rows need up to 147 KB at the tuned tiles, fp8's 256-wide K tiles 4 x 16 KB a stage: more than a
    # consumer GPU's shared memory
    launch_fitting(launch, {"num_stages": cfg["num_stages"], "block_k": cfg["block_k"]}, ("block_k", 64),
                   ("skinny", x.dtype, x.device, block_m, cfg["block_n"], split_k))
    return y


def fp8_supported(rows: torch.Tensor) -> bool:
    """Whether the fp8 kernels (skinny_fp8, rows.quantize) take these rows [M, K]: Triton runs on their device,
    which has fp8 tensor cores (or is the CPU under Triton's interpreter), and K is a multiple of 64."""
    if triton is None or rows.dim() != 2 or rows.shape[1] % 64 or not triton_works(rows.device):
        return False
    return rows.device.type != "cuda" or torch.cuda.get_device_capability(rows.device) >= (8, 9)


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-column-tile arrival counters, all zero between launches (the last arrival resets its own); one
    buffer per device serves every launch, as launches on a stream run one after another."""
    return _kept_zeros("counters", tiles, torch.int32, device, least=4096)


def _kept_zeros(use: str, n: int, dtype: torch.dtype, device: torch.device, least: int) -> torch.Tensor:
    """The current zero buffer for `use` on this device and dtype, at least n long (and at least `least`). A
    larger n gets a larger buffer; the smaller ones stay allocated, since captured graphs still point at them."""
    buffers = _KEPT_ZEROS.setdefault((use, device, dtype), [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(n, least), dtype=dtype, device=device))
    return buffers[-1]


if triton is not None:

    @triton.jit
    def fp8_tile(acc, w, x, s_ptrs, col_ok, x_scale, BLOCKS: tl.constexpr):
        """acc plus one K tile's float32 product of e4m3 tiles w [N, K] and x [K, M]; with BLOCKS the product
        times the rows' group scales x_scale [M], then times each column's block scale at s_ptrs (fp8.reference_mm's
        order; channel and row scales apply after the sum, `fp8_scaled`, and x_scale is unread). Each tile's
        product is added in float32: Hopper's fp8 MMA keeps fewer bits in its own accumulator, which over a long
        K strays ~1e-3 from the float32 sum."""
        if BLOCKS:
            return acc + tl.dot(w, x) * x_scale[None, :] * tl.load(s_ptrs, mask=col_ok, other=0.0)[:, None]
        return acc + tl.dot(w, x)

    @triton.jit
    def group_scales(xs_ptrs, row_ok, BLOCKS: tl.constexpr):
        """With BLOCKS, the rows' scales [M] of one K tile's group at xs_ptrs (fp8_tile's x_scale); else not read
        (zeros)."""
        scale = tl.zeros(row_ok.shape, tl.float32)
        if BLOCKS:
            scale = tl.load(xs_ptrs, mask=row_ok, other=0.0)
        return scale

    @triton.jit
    def row_scales(xs_ptrs, row_ok, BLOCKS: tl.constexpr):
        """Without BLOCKS, the rows' scales [M] at xs_ptrs (fp8_scaled's x_scale); else not read (zeros)."""
        scale = tl.zeros(row_ok.shape, tl.float32)
        if not BLOCKS:
            scale = tl.load(xs_ptrs, mask=row_ok, other=0.0)
        return scale

    @triton.jit
    def fp8_scaled(acc, x_scale, ws_ptrs, col_ok, BLOCKS: tl.constexpr):
        """An fp8 product's float32 sums acc [N, M] as they are stored: times (channel scale at ws_ptrs [N] x row
        scale x_scale [M]); with BLOCKS (each tile scaled already, `fp8_tile`) as they are."""
        if BLOCKS:
            return acc
        return acc * (tl.load(ws_ptrs, mask=col_ok, other=0.0)[:, None] * x_scale[None, :])

    @triton.jit
    def _skinny_kernel(X, XS, W, WS, W2, WS2, Y, Part, Count, M, N1, N, stride_x, stride_w, stride_s,
                       K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FP8: tl.constexpr, SCALE_ROWS: tl.constexpr,
                       SCALE_COLS: tl.constexpr, PDL: tl.constexpr):
        """Columns pid_n * BLOCK_N.. of y for the rows of tile pid_m, over the K slice pid_k of SPLIT_K (float32
        inputs take the exact product, not TF32: the float32 tests hold the fast path to the reference's tokens).
        Columns from N1 on are rows of the second weight W2 (N1 = N: none; N1 ends on a column tile).
        FP8: e4m3 operands, scaled after the sum by XS (per row) and WS or WS2 (per column); with SCALE_ROWS > 0
        WS holds one scale per SCALE_ROWS rows x SCALE_COLS columns (row stride stride_s) and XS one per row per
        SCALE_COLS columns ([M, K / SCALE_COLS]), and each K tile's product (BLOCK_K divides SCALE_COLS) is scaled
        by its rows' and its block's before it is added (`fp8_tile`)."""
        after_previous(PDL)
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        span: tl.constexpr = K // SPLIT_K
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = pid_k * span + tl.arange(0, BLOCK_K)
        col_ok = rn < N
        row_ok = rm < M
        second = pid_n * BLOCK_N >= N1
        w_ptrs = tl.where(second, W2 + (rn - N1)[:, None] * stride_w, W + rn[:, None] * stride_w) + rk[None, :]
        x_ptrs = X + rm[None, :] * stride_x + rk[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        s_ptrs = WS  # (unread without block scales)
        g_ptrs = XS  # (likewise)
        if SCALE_ROWS > 0:
            s_ptrs = tl.where(second, WS2 + ((rn - N1) // SCALE_ROWS) * stride_s,
                              WS + (rn // SCALE_ROWS) * stride_s) + (pid_k * span) // SCALE_COLS
            g_ptrs = XS + rm * (K // SCALE_COLS) + (pid_k * span) // SCALE_COLS
        for kk in range(0, span, BLOCK_K):
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=row_ok[None, :], other=0.0)
            if FP8:
                acc = fp8_tile(acc, w, x, s_ptrs + kk // SCALE_COLS, col_ok,
                               group_scales(g_ptrs + kk // SCALE_COLS, row_ok, SCALE_ROWS > 0), SCALE_ROWS > 0)
            else:
                acc = tl.dot(w, x, acc, input_precision=PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        ws_ptrs = WS  # (unread without FP8)
        if FP8:  # channel scales, for fp8_scaled
            ws_ptrs = tl.where(second, WS2 + (rn - N1), WS + rn)
        out_ptrs = Y + rm[None, :] * N + rn[:, None]
        out_ok = col_ok[:, None] & row_ok[None, :]
        if SPLIT_K == 1:
            if FP8:
                acc = fp8_scaled(acc, row_scales(XS + rm, row_ok, SCALE_ROWS > 0), ws_ptrs, col_ok, SCALE_ROWS > 0)
            tl.store(out_ptrs, acc.to(Y.dtype.element_ty), mask=out_ok)
        else:
            part_ptrs = Part + rm[None, :] * N + rn[:, None]
            tl.store(part_ptrs + pid_k * M * N, acc, mask=out_ok)
            tl.debug_barrier()  # every thread's partial is written before this program says it is done
            arrived = tl.atomic_add(Count + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last to finish sums the slices in order
                total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                for s in range(SPLIT_K):
                    total += tl.load(part_ptrs + s * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
                if FP8:
                    total = fp8_scaled(total, row_scales(XS + rm, row_ok, SCALE_ROWS > 0), ws_ptrs, col_ok,
                                       SCALE_ROWS > 0)
                tl.store(out_ptrs, total.to(Y.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(Count + pid_n, 0)


@probe
def _smoke_test(device: torch.device) -> None:
    """A two-row GEMM, without and with split K (the second sums its partials in the last program)."""
    for split_k in (1, 2):
        skinny_linear(torch.zeros(2, 128, device=device), torch.zeros(64, 128, device=device),
                      dict(block_n=64, block_k=64, split_k=split_k, num_warps=4, num_stages=2))
