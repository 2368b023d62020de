"""Top-k and top-p without sorting the vocabulary: one per-row threshold, found by a radix search on the GPU.

The reference `sampling.filter_logits` sorts every row for top-p (torch.sort over [N, V]) and runs
torch.topk for top-k. Inside a sampled verify on a 152k vocabulary that sort was the largest step after the
target's weights: at a 65-node tree on an H200, top-p 0.95 made the round 1.42 ms (20 %) longer and
top-k 50 0.43 ms (benchmarks/RESULTS.md). Both filters keep exactly the tokens whose logit is at least a
per-row threshold t: the largest t such that the tokens >= t number at least k (top-k) or hold at least
top_p of the probability (top-p). One Triton program per row finds t in eight passes over its row, four
bits of the logit's order-preserving bit pattern at a time (a 16-bin histogram of counts or of probability
per pass), then writes -inf below t in place.

Ties at the threshold are all kept. That is what the reference's top-k does; its top-p keeps whichever of
the tokens tied at the cut its (unstable) sort puts first, so there the two may keep different members of
a set of equal tokens, which no definition of top-p orders.
"""

from __future__ import annotations

import torch

from ddtree.fast.jit import attempt, triton_works
from ddtree.sampling import filter_logits as reference_filter_logits

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference filter
    triton = None


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The reference's min-p, then top-k, then top-p over temperature-scaled float32 logits [N, V]
    (filtered entries become -inf); on a GPU with Triton, top-k and top-p by threshold, which may write
    into `scaled`."""
    if not (scaled.is_cuda and scaled.dtype == torch.float32 and triton_works(scaled.device)):
        return reference_filter_logits(scaled, top_k, top_p, min_p)
    scaled = reference_filter_logits(scaled, 0, 1.0, min_p).contiguous()  # min-p needs only the row max
    if 0 < top_k < scaled.shape[-1]:
        kept = attempt(("top-k threshold", *scaled.shape, scaled.device), _keep_at_or_above, scaled, top_k, False)
        scaled = reference_filter_logits(scaled, top_k, 1.0, 0.0) if kept is None else kept
    if top_p < 1.0:
        kept = attempt(("top-p threshold", *scaled.shape, scaled.device), _keep_at_or_above, scaled, top_p, True)
        scaled = reference_filter_logits(scaled, 0, top_p, 0.0) if kept is None else kept
    return scaled


def _keep_at_or_above(scaled: torch.Tensor, target: float, by_mass: bool) -> torch.Tensor:
    """Mask scaled [N, V] (contiguous rows) in place below each row's threshold for `target`; returns it."""
    rows, vocab = scaled.shape
    _threshold_kernel[(rows,)](scaled, scaled.stride(0), vocab, float(target), BY_MASS=by_mass, BLOCK=1024,
                               num_warps=8)
    return scaled


if triton is not None:

    @triton.jit
    def _ordered_key(x):
        """float32 -> int64 in [0, 2^32) with the same order (-inf lowest, then negatives, zeros, positives)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits.to(tl.int64) + 2147483648, 2147483647 - (bits & 0x7FFFFFFF).to(tl.int64))

    @triton.jit
    def _threshold_kernel(X, stride, vocab, target, BY_MASS: tl.constexpr, BLOCK: tl.constexpr):
        """One row: find the largest key t whose tokens >= t weigh at least `target` (weight 1 per token, or
        its probability under softmax of the row), then set the row's tokens below t to -inf."""
        row = X + tl.program_id(0) * stride
        offsets = tl.arange(0, BLOCK)
        bins = tl.arange(0, 16)
        peak = float("-inf")
        partition = 1.0
        if BY_MASS:  # the row's max and partition function, online
            top = tl.full((BLOCK,), float("-inf"), tl.float32)
            total = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, vocab, BLOCK):
                x = tl.load(row + start + offsets, mask=start + offsets < vocab, other=float("-inf"))
                new_top = tl.maximum(top, x)
                safe = tl.where(new_top == float("-inf"), 0.0, new_top)
                total = total * tl.exp(top - safe) + tl.exp(x - safe)
                top = new_top
            peak = tl.max(top, 0)
            partition = tl.sum(total * tl.exp(top - peak), 0)
        base = tl.zeros((), tl.int64)  # the threshold's key so far: the bits above `shift` are settled
        above = tl.zeros((), tl.float32)  # weight of the tokens whose key lies above the current bin range
        for step in tl.static_range(8):
            shift = 28 - 4 * step  # bits below the current 4-bit digit
            hist = tl.zeros((16,), tl.float32)
            for start in range(0, vocab, BLOCK):
                valid = start + offsets < vocab
                x = tl.load(row + start + offsets, mask=valid, other=float("-inf"))
                digit = (_ordered_key(x) - base) >> shift  # < 0: below the range; >= 16: above it (in `above`)
                weight = tl.exp(x - peak) / partition if BY_MASS else tl.full((BLOCK,), 1.0, tl.float32)
                hit = (digit[:, None] == bins[None, :]) & valid[:, None]
                hist += tl.sum(tl.where(hit, weight[:, None], 0.0), 0)
            # from the top bin down, the first whose tokens (with all above it) reach the target
            at_or_above = above + tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0.0), 1)
            chosen = tl.max(tl.where(at_or_above >= target, bins, 0), 0)
            above += tl.sum(tl.where(bins > chosen, hist, 0.0), 0)
            base += chosen.to(tl.int64) << shift
        for start in range(0, vocab, BLOCK):
            valid = start + offsets < vocab
            x = tl.load(row + start + offsets, mask=valid, other=float("-inf"))
            tl.store(row + start + offsets, tl.where(_ordered_key(x) < base, float("-inf"), x), mask=valid)
