"""The fp8 (e4m3) weight and row formats of quantized projections, and their float32 reference.

A weight has one scale per output row (channel: what ddtree quantizes itself, a drafter or a bf16 target on
load), or one per block of rows x K columns (Qwen's published FP8 checkpoints: 128 x 128 blocks, the scale
stored as `weight_scale_inv`). Input rows are scaled on the fly (dynamic activation scales), as each format's
own scheme says: before a channel-scaled weight each row by its own largest magnitude (per token, vLLM's
FP8-dynamic scheme); before a block-scaled weight each 128-column group of a row by its own (per token per 128
columns, one scale per 1 x 128 group: how transformers' fine-grained FP8 and vLLM's W8A8 block FP8 run the
checkpoints). Products of fp8 values are exact in float32, which accumulates them; a channel scale and a row's
scale apply after the whole sum, a block's and a group's after each K block's sum. The GPU kernels (rows.py,
gemm.py, moe.py) compute exactly the functions defined here; this module is what they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
TINY = 1e-12  # the scale floor of an all-zero row
WEIGHT_BLOCK = 8192  # weight rows quantized at a time (float32 scratch: 8192 x K x 4 bytes)


SCALE_BLOCK = 128  # the K columns (and rows) a published checkpoint's block scale covers


@dataclass(frozen=True)
class Fp8Weight:
    """A weight [N, K] as fp8 values `data` and float32 scales: one per output row (`block` None, scale [N]:
    weight ≈ data * scale[:, None]), or one per block of `block` = (rows, columns) (scale [ceil(N / rows),
    ceil(K / columns)]: weight ≈ data * scale repeated over each block). Rows 1 is a block format too: a fused
    weight whose parts do not end on a 128-row block keeps each row's K-block scales (`expand_rows`). A mixture-of-
    experts block's experts stack as one: data [E, N, K] and each scale tensor with a leading E (`[e]`: expert e's)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __getitem__(self, expert: int) -> Fp8Weight:
        """Expert `expert`'s weight of stacked experts."""
        return Fp8Weight(self.data[expert], self.scale[expert], self.block)

    def rows(self, start: int, end: int) -> Fp8Weight:
        """Rows start..end-1 with their scales (block rows must start on a block)."""
        if self.block is None:
            return Fp8Weight(self.data[start:end], self.scale[start:end])
        r = self.block[0]
        if start % r:
            raise ValueError(f"rows from {start} do not start on a {r}-row scale block")
        return Fp8Weight(self.data[start:end], self.scale[start // r:-(-end // r)], self.block)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """Each row scaled so that its largest magnitude is e4m3's largest value, then rounded to nearest (even). In
    blocks of rows, so that a large LM head needs little float32 scratch memory."""
    rows = weight.shape[0]
    data = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(rows, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, WEIGHT_BLOCK):
        data[start:start + WEIGHT_BLOCK], scale[start:start + WEIGHT_BLOCK] = quantize_rows(
            weight.detach()[start:start + WEIGHT_BLOCK])
    return Fp8Weight(data, scale)


def quantize_blocks(weight: torch.Tensor, block: int = SCALE_BLOCK) -> Fp8Weight:
    """A weight [N, K] as Qwen's FP8 checkpoints store it: e4m3 values and one float32 scale per block x block
    tile (partial tiles at the edges), the tile's largest magnitude mapped to e4m3's largest value."""
    n, k = weight.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = weight.new_zeros((rows * block, cols * block), dtype=torch.float32)
    padded[:n, :k] = weight.detach()
    tiles = padded.view(rows, block, cols, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=TINY) * (1.0 / FP8_MAX)
    values = (tiles / scale[:, None, :, None]).view(rows * block, cols * block)[:n, :k]
    return Fp8Weight(values.to(FP8), scale, (block, block))


def expand_rows(weight: Fp8Weight) -> Fp8Weight:
    """A block-scaled weight with each row's own copy of its K-block scales (block rows 1): rows of it can be
    cut and joined anywhere, at 4 bytes per K block per row (1/32 of the fp8 bytes at 128-wide blocks)."""
    if weight.block is None or weight.block[0] == 1:
        return weight
    scale = weight.scale.repeat_interleave(weight.block[0], dim=0)[:weight.shape[0]]
    return Fp8Weight(weight.data, scale.contiguous(), (1, weight.block[1]))


def dequantize(weight: Fp8Weight) -> torch.Tensor:
    """The float32 weight the fp8 values and their scales stand for."""
    n, k = weight.shape
    if weight.block is None:
        return weight.data.float() * weight.scale[:, None]
    rows, cols = weight.block
    scale = weight.scale.repeat_interleave(rows, dim=0)[:n].repeat_interleave(cols, dim=1)[:, :k]
    return weight.data.float() * scale


def activation_group(weight: Fp8Weight) -> int | None:
    """The columns of an input row that one activation scale covers before `weight`: a block-scaled weight's K
    block (per token per 128 columns, the checkpoints' scheme), None for a channel-scaled one (the whole row)."""
    return weight.block[1] if weight.block is not None else None


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M, K] as fp8 values and float32 scales (the reference for the GPU kernels): one per row [M], or with
    `group` one per `group` columns of each row [M, ceil(K / group)]. Scale = the largest magnitude it covers x
    float32(1 / FP8_MAX), each value / its scale rounded to nearest even (a division of two tensors, correctly
    rounded on every device: torch divides by a scalar as a product with its reciprocal on CUDA, and the kernel
    must give the same bits)."""
    xf = x.float()
    if group is None:
        scale = xf.abs().amax(dim=1).clamp(min=TINY) * (1.0 / FP8_MAX)
        return (xf / scale[:, None]).to(FP8), scale
    m, k = xf.shape
    groups = -(-k // group)
    padded = xf.new_zeros((m, groups * group))
    padded[:, :k] = xf.abs()
    scale = padded.view(m, groups, group).amax(dim=2).clamp(min=TINY) * (1.0 / FP8_MAX)
    return (xf / scale.repeat_interleave(group, dim=1)[:, :k]).to(FP8), scale


@dataclass(frozen=True)
class QuantizedRows:
    """Rows [M, K] quantized once for several projections that read them (a draft layer's q and k/v): fp8
    `values`, their `scale`s (per row [M], or per `group` columns [M, ceil(K / group)]: `quantize_rows`), and the
    `dtype` of the rows they stand for (the products')."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    group: int | None = None


def check_rows(rows: QuantizedRows, weight: Fp8Weight) -> None:
    """Raise unless the rows are quantized in the scheme `weight`'s format reads (`activation_group`)."""
    group = activation_group(weight)
    if rows.group != group:
        def per(g: int | None) -> str:
            return f"{g} columns" if g else "row"
        raise ValueError(f"rows with one scale per {per(rows.group)} meet a weight that reads one per {per(group)}")


def reference_mm(rows: QuantizedRows, weight: Fp8Weight) -> torch.Tensor:
    """rows @ weight^T -> [M, N] in the rows' dtype: the fp8 products summed, then scaled by (row scale x channel
    scale), as the GPU kernel does. A block-scaled weight (rows quantized per 128-column group): each K block's
    sum times its rows' group scales, then times its weight blocks' scales, added in K order in float32 (vLLM's
    and transformers' order). The sums run in float64 and round to float32: exact (so in any order) up to 512
    products, where a float32 product's order would follow the row count (a CPU BLAS picks its kernel by shape),
    and a row's result, quantized again by the next projection, would depend on its batch."""
    check_rows(rows, weight)
    if weight.block is None:
        acc = (rows.values.double() @ weight.data.double().T).float()
        return (acc * (rows.scale[:, None] * weight.scale[None, :])).to(rows.dtype)
    n, k = weight.shape
    block_rows, cols = weight.block
    scale = weight.scale.repeat_interleave(block_rows, dim=0)[:n]  # [N, K blocks]
    values, data = rows.values.double(), weight.data.double()
    acc = torch.zeros(values.shape[0], n, dtype=torch.float32, device=values.device)
    for j, k0 in enumerate(range(0, k, cols)):
        acc += (values[:, k0:k0 + cols] @ data[:, k0:k0 + cols].T).float() * rows.scale[:, j, None] * scale[None, :, j]
    return acc.to(rows.dtype)


def reference_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ weight^T with x quantized in the weight's scheme (`activation_group`): the function the fp8
    kernels compute."""
    group = activation_group(weight)
    return reference_mm(QuantizedRows(*quantize_rows(x, group), x.dtype, group), weight)
