"""DFlash2's two modules on top of the DFlash backbone: the two-tap dynamic convolution and the candidate selector.

A DFlash2 drafter (`architectures: ["DFlash2DraftModel"]`, z-lab with Inco AI, 2026) is a DFlash drafter whose
layers convolve the block stream around each attention and each MLP, and which adds a selector: a low-rank
bilinear score between adjacent positions' top-k candidates. DFlash's per-position marginals are independent;
the selector's scores are a first-order transition model over them, which is what a chain (pick each position's
best candidate given the previous pick) and a DDTree over prefixes (core/tree.py `build_selector_tree`) draft
from. The drafter module itself is ddtree.models.draft.DFlashDraft, which builds these when its config has a
`SelectorConfig`; this module imports nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.errors import DDTreeError

MARKERS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class SelectorConfig:
    """DFlash2's fields (dflash_config): the convolution's taps K and channel group G, the selector's rank r and
    candidates k."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


def parse_selector_config(raw: dict, hidden_size: int, vocab_size: int, where: str) -> SelectorConfig | None:
    """DFlash2's fields of a config (None for a DFlash one), or a one-line error for a config that mixes the two
    families or holds impossible values."""
    dc = raw.get("dflash_config") or {}
    archs = raw.get("architectures") or []
    values = {k: dc.get(k, raw.get(k)) for k in MARKERS}
    given = [k for k, v in values.items() if v is not None]
    dflash2 = any("DFlash2" in a for a in archs)
    if not dflash2 and not given:
        return None
    if not dflash2 and "DFlashDraftModel" in archs:
        raise DDTreeError(f"{where}: inconsistent: a DFlashDraftModel config with DFlash2 fields ({', '.join(given)})")
    missing = [k for k in MARKERS if values[k] is None]
    if missing:
        raise DDTreeError(f"{where}: DFlash2 config without dflash_config.{', '.join(missing)}")
    try:
        cfg = SelectorConfig(*(int(values[k]) for k in MARKERS))
    except (TypeError, ValueError):
        raise DDTreeError(f"{where}: DFlash2 fields must be integers, got {values}") from None
    if min(cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) < 1:
        raise DDTreeError(f"{where}: DFlash2 fields must be at least 1, got {values}")
    if hidden_size % cfg.conv_group_size:
        raise DDTreeError(f"{where}: conv_group_size {cfg.conv_group_size} does not divide hidden_size {hidden_size}")
    if cfg.selector_top_k > vocab_size:
        raise DDTreeError(f"{where}: selector_top_k {cfg.selector_top_k} exceeds the vocabulary ({vocab_size})")
    return cfg


def dynamic_conv(x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The two-tap dynamic convolution along each block's rows (dflash2.md §3), causal, zero before row 0:
    out[t] = Σ_o (base[o] + taps[t, o]) ⊙ x[t − o], base [K, H] per channel, taps [..., T, K, H/G] per group
    of G channels; x [..., T, H] with T one block's rows. Summed in float32, rounded once to x's dtype."""
    rows, width = x.shape[-2:]
    groups = taps.shape[-1]
    xf, tf, bf = x.float(), taps.float(), base.float()
    out = torch.zeros_like(xf)
    for offset in range(base.shape[0]):
        shifted = F.pad(xf, (0, 0, offset, 0))[..., :rows, :] if offset else xf  # x[t - offset]
        dynamic = (shifted.unflatten(-1, (groups, width // groups)) * tf[..., offset, :, None]).flatten(-2)
        out = out + bf[offset] * shifted + dynamic
    return out.to(x.dtype)


class DynamicConv(nn.Module):
    """One layer's pair of convolutions around its attention (or its MLP): static taps `base_kernel` [2, K, H]
    ([0] before, [1] after), and content-dependent per-group taps projected from the sub-block's normed input."""

    def __init__(self, hidden_size: int, cfg: SelectorConfig) -> None:
        super().__init__()
        self.kernel_size, self.groups = cfg.conv_kernel_size, hidden_size // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, cfg.conv_kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * cfg.conv_kernel_size * self.groups, bias=False)

    def taps(self, h: torch.Tensor) -> torch.Tensor:
        """The dynamic taps of normed rows h [..., T, H]: [..., T, 2, K, H/G] (both convolutions' from the FIRST
        input: the second convolution reuses them)."""
        return self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, self.groups))

    def forward(self, x: torch.Tensor, taps: torch.Tensor, which: int, block_size: int) -> torch.Tensor:
        """Convolution `which` (0 before, 1 after) of x [B, T, H], T a whole number of blocks, each on its own."""
        blocks = x.unflatten(1, (-1, block_size))
        out = dynamic_conv(blocks, taps[:, :, which].unflatten(1, (-1, block_size)), self.base_kernel[which])
        return out.flatten(1, 2)


class CandidateSelector(nn.Module):
    """Scores a position's top-k candidates given the previous position's token (dflash2.md §5):
    score_t(prev, c) = unary_t[c] + ⟨predecessor_codebook[prev] ⊙ hidden_projection(h_t), successor_codebook[c]⟩.

    The codebooks are stored without a `.weight` suffix, as the published checkpoints hold them."""

    def __init__(self, vocab_size: int, hidden_size: int, cfg: SelectorConfig) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(hidden_size, cfg.selector_rank, bias=False)

    def scores(self, unary: torch.Tensor, candidates: torch.Tensor, previous: torch.Tensor,
               hidden: torch.Tensor) -> torch.Tensor:
        """unary [..., k] (float32) of token ids candidates [..., k], given each of previous [..., P] (token ids),
        at positions with hidden states [..., H] -> float32 scores [..., P, k]: one batched product for a block."""
        p = self.hidden_projection(hidden)
        predecessors = self.predecessor_codebook[previous] * p[..., None, :]
        bilinear = predecessors @ self.successor_codebook[candidates].transpose(-1, -2)
        return unary[..., None, :] + bilinear.float()

    def transition_logp(self, unary: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor,
                        anchor: torch.Tensor) -> torch.Tensor:
        """The block's transition model (dflash2.md §6): logp [D, k, k], logp[d, i, j] = log P(candidate j at
        depth d+1 | candidate i at depth d), softmax over the k candidates; depth 1 is conditioned on the
        anchor, in every row. unary, candidates [D, k]; hidden [D, H]; anchor a token id (a 0-d tensor). With
        leading dims (a batch of blocks: [B, D, k], [B, D, H], anchors [B]) each block's model, in one product."""
        k = candidates.shape[-1]
        first = anchor.reshape(*anchor.shape, 1, 1).expand(*anchor.shape, 1, k).to(candidates.dtype)
        previous = torch.cat([first, candidates[..., :-1, :]], dim=-2)
        return torch.log_softmax(self.scores(unary, candidates, previous, hidden), dim=-1)
