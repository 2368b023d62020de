"""cos and sin of the rotary embedding at a forward's positions, from a table filled once per cache position.

A transformers rotary module recomputes them on every call: an outer product of its inverse frequencies with
the positions, a concatenation, cos, sin, the attention scaling and a cast to the model's dtype, about eight
small kernels per forward, three forwards a round (the target's, the draft block's and the draft context's).
Every entry is elementwise arithmetic on one (frequency, position) pair, so calling the module once over
every cache position gives each position's bits exactly; a forward then gathers its rows in one launch. On
the 8B shape, in one process, that took 0.018 ms off an AR step and 0.026-0.029 ms off a B = 16 round.

Rotary types whose frequencies depend on the sequence length seen (transformers' `dynamic` NTK scaling and
LongRoPE, updated inside the module's forward) keep calling the module.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.kernels.gather import gather_rows

LENGTH_DEPENDENT = ("dynamic", "longrope")


class RopeTable:
    """cos, sin [n, d] for positions [n]: a gather from the table of `rotary` over positions 0..size-1, or (for
    a length-dependent rotary type) the module itself. The table keeps cos and sin side by side, [size, 2, d], so
    one gather fetches both; the two results are views of it with a row stride of 2d."""

    def __init__(self, rotary: nn.Module, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rotary, self.dtype = rotary, dtype
        rope_type = getattr(rotary, "rope_type", "default")
        self.table: torch.Tensor | None = None
        if isinstance(rope_type, str) and rope_type not in LENGTH_DEPENDENT:
            cos, sin = self._from_module(torch.arange(size, device=device))
            self.table = torch.stack([cos, sin], dim=1)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None:
            return self._from_module(positions)
        both = gather_rows(self.table.view(self.table.shape[0], -1), positions).view(-1, *self.table.shape[1:])
        return both[:, 0], both[:, 1]

    def _from_module(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's own cos and sin [n, d] (a Qwen3.5 M-RoPE module takes its three position rows, which
        for text are all the token's position)."""
        rows = positions[None]
        if hasattr(self.rotary, "mrope_section"):
            rows = positions.view(1, 1, -1).expand(3, 1, -1)
        like = torch.empty(0, dtype=self.dtype, device=positions.device)  # read for its dtype and device only
        cos, sin = self.rotary(like, rows)
        return cos[0], sin[0]
