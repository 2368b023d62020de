"""DDTree construction on the device: static shapes, a few dozen kernels, no host synchronisation.

Same trees as ddtree.tree (the host's best-first search), as tensors a CUDA graph can replay.
"""

from __future__ import annotations

import torch

from ddtree.kernels.jit import after_previous, attempt, pdl, probe, program_block, triton_works

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch loop below
    triton = None


def tree_size(max_depth: int, vocab: int, budget: int) -> int:
    """Draft nodes a budget-`budget` tree holds: the budget, unless fewer prefixes exist at all."""
    k = min(budget, vocab)
    return min(budget, sum(min(budget, k**d) for d in range(1, max_depth + 1)))


def top_prefixes(draft_logits: torch.Tensor, budget: int,
                 token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The `budget` most probable prefixes of the per-depth product distribution, as tensors on the device.

    Same set as tree.build_tree (barring exact score ties). The best `budget` prefixes of depth d can only
    extend the best `budget` of depth d-1 (a prefix scores at least as well as its extensions), so every
    depth keeps exactly `budget` slots, sorted best first (unused ones score -inf). Extending slot i by the
    j-th best token is beaten by every (i' <= i, j' <= j), so only the (i+1)(j+1) <= budget "frontier"
    pairs can make the cut: one small selection per depth (~B ln B candidates, not B * k) finds them. One
    stable ordering by score (shallower first on ties) then numbers the nodes best-first, so every parent
    precedes its children. Returns (tokens [N-1], parents [N], depths [N], visible [N, N] bool: each node
    and its ancestors), N = nodes + 1 with the root at 0 (parent 0, depth 0). Column c of the logits is token
    token_ids[c] when given (a draft vocabulary: ddtree.draft_vocab), else token c.
    """
    max_depth, vocab = draft_logits.shape
    k = min(budget, vocab)
    device = draft_logits.device
    logp, tok = vocab_top(draft_logits, k, token_ids)
    pairs = _frontier(budget, k, device)
    n = tree_size(max_depth, vocab, budget)
    if triton_works(device):
        built = attempt(("tree", max_depth, k, budget, device), _build_on_gpu, logp, tok, pairs, budget, n)
        if built is not None:
            return built
    tokens, parents, depths, _ = _build_torch(logp[None], tok[None], pairs, budget, n)
    return tokens[0], parents[0], depths[0], ancestors(parents[0], max_depth)


def batch_prefixes(logp: torch.Tensor, tok: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """`top_prefixes` for many blocks at once, from their vocabulary top-k (`vocab_top`: logp and tokens
    [S, D, k], best first; a depth a block must not draft scores -inf). Returns each block's nodes best first:
    (tokens [S, N], parents [S, N+1], depths [S, N+1], scores [S, N]: each node's prefix log-probability),
    N = tree_size(D, k, budget), root at 0. Nodes past a block's finite scores exist only to fill N: cut them.
    One Triton program per block on a GPU (the single tree's kernel), the same PyTorch loop elsewhere."""
    blocks, max_depth, k = logp.shape
    pairs = _frontier(budget, k, logp.device)
    n = tree_size(max_depth, k, budget)
    if triton_works(logp.device):
        built = attempt(("tree batch", blocks, max_depth, k, budget, logp.device), _build_batch_on_gpu, logp, tok,
                        pairs, budget, n)
        if built is not None:
            return built[0], built[1], built[2], built[4]
    return _build_torch(logp, tok, pairs, budget, n)


def _build_torch(logp: torch.Tensor, tok: torch.Tensor, pairs: torch.Tensor, budget: int,
                 n: int) -> tuple[torch.Tensor, ...]:
    """The per-depth PyTorch loop over blocks [S, D, k]: (tokens [S, n], parents, depths [S, n+1], node scores
    [S, n]). Static shapes and no host synchronisation: a CUDA graph may capture it."""
    blocks, max_depth, k = logp.shape
    device = logp.device
    scores = logp.new_full((blocks, max_depth, budget), float("-inf"))
    scores[:, 0, :k] = logp[:, 0]
    picks = torch.arange(budget, device=device).remainder(k).repeat(blocks, max_depth, 1)  # flat [budget x k]
    for d in range(1, max_depth):
        cand = (scores[:, d - 1, :, None] + logp[:, d, None, :]).flatten(1)[:, pairs]
        best, order = cand.sort(dim=1, descending=True, stable=True)
        scores[:, d], picks[:, d] = best[:, :budget], pairs[order[:, :budget]]
    depth = torch.arange(max_depth, device=device)[None, :, None]
    tokens = tok.gather(2, picks.remainder(k))
    parent_slot = torch.where(depth > 0, (depth - 1) * budget + picks.div(k, rounding_mode="floor"), -1)
    flat = scores.flatten(1)
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :n]
    node_of = torch.zeros((blocks, max_depth * budget), dtype=torch.long, device=device)
    node_of.scatter_(1, order, torch.arange(1, n + 1, device=device).expand(blocks, n))
    parent = parent_slot.flatten(1).gather(1, order)
    root = torch.zeros((blocks, 1), dtype=torch.long, device=device)
    parents = torch.cat([root, torch.where(parent >= 0, node_of.gather(1, parent.clamp(min=0)), 0)], dim=1)
    depths = torch.cat([root, order.div(budget, rounding_mode="floor") + 1], dim=1)
    return tokens.flatten(1).gather(1, order), parents, depths, flat.gather(1, order)


def vocab_top(logits: torch.Tensor, k: int,
              token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the k most probable tokens, best first: (log-probabilities [D, k] float32, tokens [D, k]);
    column c is token token_ids[c] when given.

    On CUDA two Triton kernels read the logits once: every vocabulary chunk keeps its own top k and its
    max / sum of exponentials, and one program per row merges them and maps the columns to token ids
    (torch.topk and logsumexp take several kernels and ~75 µs for 15 rows; these take a few).
    """
    if triton_works(logits.device):
        top = attempt(("vocabulary top-k", *logits.shape, k, logits.dtype, logits.device), _vocab_top_on_gpu,
                      logits, k, token_ids)
        if top is not None:
            return top
    logp, tok = _vocab_top_torch(logits, k)
    return logp, tok if token_ids is None else token_ids[tok]


def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64: torch.argmax(dim=-1), the lowest token among equal maxima and any NaN above
    every number. On CUDA two Triton kernels with programmatic dependent launch: each vocabulary chunk keeps its
    best (logit, token) key, one program per row takes the best of its chunks' (torch's reduction took 22 µs
    for a B = 64 verify's 65 rows of 151936 bf16 logits)."""
    if triton_works(logits.device) and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] < 2 ** 31:
        best = attempt(("vocabulary argmax", *logits.shape, logits.dtype, logits.device), _vocab_argmax_on_gpu,
                       logits, min(program_block(logits.shape[1], logits.device, ARGMAX_CHUNK), 1 << 16))
        if best is not None:
            return best
    return logits.argmax(dim=-1)


def vocab_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                 floor: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] -> [N] int64: row r's vocab_argmax where temperature[r] (float32 [N]) is 0, else a sample of
    softmax(logits[r] / temperature[r]) by Gumbel-max (the logits divided in float32, as process_logits does),
    over the tokens whose logit is at least floor[r] where `floor` (float32 [N]) is given: the filters' survivors
    (core/sampling.py `filter_floor`).
    On CUDA the uniforms come from Philox at (the int64 at `seed` [1]; r * V + column) inside the argmax kernels:
    greedy rows cost what vocab_argmax costs, and a graph replays with whatever seed its buffer holds, so a new
    seed each round gives independent draws. A uniform of exactly 0 gives its token -inf (never picked), the
    safe side. Elsewhere torch.rand draws them."""
    if triton_works(logits.device) and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] < 2 ** 31:
        best = attempt(("vocabulary sample", *logits.shape, logits.dtype, floor is not None, logits.device),
                       _vocab_sample_on_gpu,
                       logits, temperature, seed, floor,
                       min(program_block(logits.shape[1], logits.device, ARGMAX_CHUNK), 1 << 16))
        if best is not None:
            return best
    wide = logits.float()
    gumbel = -torch.log(-torch.log(torch.rand(wide.shape, device=wide.device)))
    scaled = wide / temperature[:, None].clamp(min=1e-30)
    if floor is not None:
        gumbel = torch.where(wide >= floor[:, None], gumbel, float("-inf"))
    return torch.where(temperature[:, None] > 0, scaled + gumbel, wide).argmax(dim=-1)


def _vocab_sample_on_gpu(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                         floor: torch.Tensor | None, chunk: int) -> torch.Tensor:
    rows, vocab = logits.shape
    chunks = -(-vocab // chunk)
    candidates = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
    best = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_sample_kernel[(rows, chunks)](logits, logits.stride(0), vocab, temperature, seed,
                                         temperature if floor is None else floor, candidates, chunks, CHUNK=chunk,
                                         FLOOR=floor is not None, num_warps=4)
    _merge_argmax_kernel[(rows,)](candidates, best, chunks, CHUNKS=_pow2(chunks, least=2), PDL=False, num_warps=1)
    return best


ARGMAX_CHUNK = 4096  # logits per chunk program on a GPU (`jit.program_block`); 16-bit keys hold at most 2**16


def _vocab_argmax_on_gpu(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    rows, vocab = logits.shape
    chunks = -(-vocab // chunk)
    candidates = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
    best = torch.empty(rows, dtype=torch.int64, device=logits.device)
    dependent = pdl(logits.device)
    _chunk_argmax_kernel[(rows, chunks)](logits, logits.stride(0), vocab, candidates, chunks, CHUNK=chunk,
                                         HALF=logits.element_size() == 2, PDL=dependent, num_warps=4,
                                         launch_pdl=dependent)
    _merge_argmax_kernel[(rows,)](candidates, best, chunks, CHUNKS=_pow2(chunks, least=2), PDL=dependent,
                                  num_warps=1, launch_pdl=dependent)
    return best


def _vocab_top_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vocab_top with torch.topk and logsumexp: the CPU path, and the baseline the kernels are timed against."""
    logits = logits.float()
    top, tok = logits.topk(k, dim=-1)
    return top - logits.logsumexp(dim=-1, keepdim=True), tok


_FRONTIERS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _frontier(budget: int, k: int, device: torch.device) -> torch.Tensor:
    """Flat indices i * k + j of the (slot i, token j) pairs with (i+1)(j+1) <= budget, i-major.

    Cached per device: made on the first (warm-up) call, so a CUDA graph capture never copies from the host.
    """
    key = (budget, k, device)
    if key not in _FRONTIERS:
        pairs = [i * k + j for i in range(budget) for j in range(k) if (i + 1) * (j + 1) <= budget]
        _FRONTIERS[key] = torch.tensor(pairs, device=device)
    return _FRONTIERS[key]


def _pow2(n: int, least: int = 16) -> int:
    """The power of two >= n (and >= `least`): Triton blocks and bitonic networks come in powers of two."""
    return max(least, 1 << max(n - 1, 0).bit_length())


def _vocab_top_on_gpu(logits: torch.Tensor, k: int,
                      token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    top = _pow2(k)
    chunk = _chunk_width(vocab, top)
    half = logits.element_size() == 2
    chunks = -(-vocab // chunk)
    candidates = torch.empty((rows, chunks * top), dtype=torch.int64, device=logits.device)
    stats = torch.empty((rows, 2, chunks), dtype=torch.float32, device=logits.device)  # chunk max, sum of exp
    _chunk_top_kernel[(rows, chunks)](logits, logits.stride(0), vocab, candidates, stats, chunks, CHUNK=chunk,
                                      TOP=top, HALF=half, num_warps=_chunk_warps(chunk, half))
    logp = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
    tokens = torch.empty((rows, k), dtype=torch.int64, device=logits.device)
    _merge_top_kernel[(rows,)](candidates, stats, logp, tokens, tokens if token_ids is None else token_ids, chunks, k,
                               SPAN=_pow2(chunks * top), CHUNKS=_pow2(chunks), TOP=top, MAPPED=token_ids is not None,
                               num_warps=4)
    return logp, tokens


def _chunk_width(vocab: int, top: int) -> int:
    """Logits per chunk program: ~2048 candidates a row, chunks of 1024..16384 logits (and never much wider
    than the vocabulary)."""
    return min(max(1024, min(_pow2(vocab * top // 2048), 16384), top), max(_pow2(vocab), top))


def _chunk_warps(chunk: int, half: bool) -> int:
    """Launch width of the chunk top-k. 16-bit logits' int32 keys: from a sweep on an H200 (bf16, vocabulary
    151936). float32's int64 keys keep the widths they were timed at (8 warps at k = 64 took
    152 us where 16 took 141)."""
    if half:
        return 4 if chunk <= 2048 else 8 if chunk <= 8192 else 16
    return 8 if chunk <= 4096 else 16


def _tree_warps(budget: int) -> int:
    """Launch width of the tree kernel: its selections are bitonic networks, wider for bigger budgets."""
    return 8 if budget <= 32 else 16


def _build_on_gpu(logp: torch.Tensor, tok: torch.Tensor, pairs: torch.Tensor, budget: int,
                  n: int) -> tuple[torch.Tensor, ...]:
    """top_prefixes after the vocabulary top-k, as one Triton program: a kernel launch costs more than a
    depth's work, so the per-depth loop, the best-first numbering, the parent lookup and the ancestor
    matrix come from one launch."""
    built = _build_batch_on_gpu(logp[None], tok[None], pairs, budget, n)
    return tuple(t[0] for t in built[:4])


def _build_batch_on_gpu(logp: torch.Tensor, tok: torch.Tensor, pairs: torch.Tensor, budget: int,
                        n: int) -> tuple[torch.Tensor, ...]:
    """One program per block [S, D, k]: (tokens [S, n], parents, depths [S, n+1], visible [S, n+1, n+1],
    node scores [S, n])."""
    blocks, max_depth, k = logp.shape
    device = logp.device
    every = _pow2(max_depth * budget)
    scores = torch.empty((blocks, max_depth, budget), dtype=torch.float32, device=device)
    picks = torch.empty((blocks, max_depth, budget), dtype=torch.int64, device=device)
    node_of = torch.empty((blocks, max_depth * budget), dtype=torch.int64, device=device)
    tokens = torch.empty((blocks, n), dtype=torch.int64, device=device)
    node_scores = torch.empty((blocks, n), dtype=torch.float32, device=device)
    parents = torch.empty((blocks, n + 1), dtype=torch.int64, device=device)
    depths = torch.empty((blocks, n + 1), dtype=torch.int64, device=device)
    visible = torch.zeros((blocks, n + 1, n + 1), dtype=torch.uint8, device=device)
    _tree_kernel[(blocks,)](logp.float().contiguous(), tok.contiguous(), pairs, scores, picks, node_of, tokens,
                            node_scores, parents, depths, visible, pairs.numel(), k, budget, n, MAX_DEPTH=max_depth,
                            SPAN=_pow2(pairs.numel()), BUDGET=_pow2(budget), EVERY=every, NODES=_pow2(n),
                            ROWS=_pow2(n + 1), num_warps=_tree_warps(budget))
    return tokens, parents, depths, visible.view(torch.bool), node_scores


if triton is not None:
    @triton.jit
    def _key(score, rank):
        """int64 sort key: an order-preserving integer image of the float score, then `rank` (ties)."""
        bits = score.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
        return (ordered.to(tl.int64) << 32) | rank.to(tl.int64)

    @triton.jit
    def _ordered16(bits):
        """A 16-bit float's bits (sign-extended to int32) -> an int32 whose signed order is the float's; the
        map is its own inverse, so it also turns such an int back into the float's bits."""
        return bits ^ ((bits >> 15) & 0x7FFF)

    @triton.jit
    def _key_score(key):
        high = (key >> 32).to(tl.int32)
        return (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _chunk_top_kernel(Logits, stride, vocab, Candidates, Stats, chunks, CHUNK: tl.constexpr, TOP: tl.constexpr,
                          HALF: tl.constexpr):
        """One vocabulary chunk of one row: its TOP best (score, token) keys, its max and sum of exp.

        16-bit logits select on int32 keys (the logit's 16 bits, then the complement of its column in the
        chunk), which a bitonic top-k compares and swaps in half the instructions of int64 ones; only the
        TOP winners become the merge's int64 keys."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        local = tl.arange(0, CHUNK)
        col = chunk * CHUNK + local
        raw = tl.load(Logits + row * stride + col, mask=col < vocab, other=float("-inf"))
        x = raw.to(tl.float32)
        if HALF:
            lowest16 = -2147483647 - 1
            ordered = _ordered16(raw.to(tl.int16, bitcast=True).to(tl.int32))
            best16 = tl.topk(tl.where(col < vocab, (ordered << 16) | (65535 - local), lowest16), TOP)
            value = _ordered16(best16 >> 16).to(tl.int16).to(raw.dtype, bitcast=True).to(tl.float32)
            best_col = chunk * CHUNK + 65535 - (best16 & 0xFFFF)
            best = tl.where(best16 != lowest16, _key(value, 2147483647 - best_col), -9223372036854775807)
        else:
            # 2**31 - 1 - token in the low bits: the lower token first on equal logits
            best = tl.topk(tl.where(col < vocab, _key(x, 2147483647 - col), -9223372036854775807), TOP)
        tl.store(Candidates + (row * chunks + chunk) * TOP + tl.arange(0, TOP), best)
        top = tl.max(x, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        tl.store(Stats + row * 2 * chunks + chunk, top)
        tl.store(Stats + (row * 2 + 1) * chunks + chunk, tl.sum(tl.exp(x - top), axis=0))

    @triton.jit
    def _chunk_argmax_kernel(Logits, stride, vocab, Candidates, chunks, CHUNK: tl.constexpr, HALF: tl.constexpr,
                             PDL: tl.constexpr):
        """One vocabulary chunk of one row: an int64 key of its best logit (the logit's order-preserving image in
        the high bits, the complement of its token in the low ones, so the lowest token wins ties, -0.0 and +0.0
        among them); a NaN's image is the largest there is, above +inf's."""
        after_previous(PDL)
        row, chunk = tl.program_id(0), tl.program_id(1)
        local = tl.arange(0, CHUNK)
        col = chunk * CHUNK + local
        raw = tl.load(Logits + row.to(tl.int64) * stride + col, mask=col < vocab, other=float("-inf"))
        wide = raw.to(tl.float32)
        nan = wide != wide
        if HALF:  # int32 keys: the logit's ordered 16 bits, then the complement of its column in the chunk
            bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
            ordered = tl.where(nan, 0x7FFF, _ordered16(tl.where(bits == -32768, 0, bits)))  # -0.0 ties +0.0
            lowest16 = -2147483647 - 1
            best16 = tl.max(tl.where(col < vocab, (ordered << 16) | (65535 - local), lowest16), axis=0)
            best_col = chunk * CHUNK + 65535 - (best16 & 0xFFFF)
            best = ((best16 >> 16).to(tl.int64) << 32) | (2147483647 - best_col).to(tl.int64)
        else:
            best = _best_wide_key(wide, col, vocab)
        tl.store(Candidates + row * chunks + chunk, best)

    @triton.jit
    def _best_wide_key(wide, col, vocab):
        """The int64 key of a chunk's best float32 value: its order-preserving image in the high bits, the
        complement of its column in the low ones (the lowest column wins ties, -0.0 and +0.0 among them); a NaN's
        image is the largest there is, above +inf's."""
        key = _key(tl.where(wide == 0.0, 0.0, wide), 2147483647 - col)  # -0.0 ties +0.0
        key = tl.where(wide != wide, (tl.full(key.shape, 0x7FFFFFFF, tl.int64) << 32) | (2147483647 - col), key)
        return tl.max(tl.where(col < vocab, key, -9223372036854775807), axis=0)

    @triton.jit
    def _chunk_sample_kernel(Logits, stride, vocab, Temperature, Seed, Floor, Candidates, chunks, CHUNK: tl.constexpr,
                             FLOOR: tl.constexpr):
        """_chunk_argmax_kernel's float32 keys over logit / T + Gumbel noise where the row samples (T > 0; with
        FLOOR, -inf where the logit is below the row's floor), over the logits themselves where it does not (the
        same order as their 16-bit keys, so the same pick)."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        local = tl.arange(0, CHUNK)
        col = chunk * CHUNK + local
        wide = tl.load(Logits + row.to(tl.int64) * stride + col, mask=col < vocab, other=float("-inf")).to(tl.float32)
        temperature = tl.load(Temperature + row)
        if temperature > 0:
            uniform = tl.rand(tl.load(Seed), row.to(tl.int64) * vocab + col)
            sample = wide / temperature - tl.log(-tl.log(uniform))
            if FLOOR:
                sample = tl.where(wide >= tl.load(Floor + row), sample, float("-inf"))
            wide = sample
        tl.store(Candidates + row * chunks + chunk, _best_wide_key(wide, col, vocab))

    @triton.jit
    def _merge_argmax_kernel(Candidates, Best, chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr):
        """One row: the token of its chunks' best key."""
        after_previous(PDL)
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS)
        key = tl.max(tl.load(Candidates + row * chunks + c, mask=c < chunks, other=-9223372036854775807), axis=0)
        tl.store(Best + row, 2147483647 - (key & 0xFFFFFFFF))

    @triton.jit
    def _merge_top_kernel(Candidates, Stats, Logp, Tokens, TokenIds, chunks, k, SPAN: tl.constexpr,
                          CHUNKS: tl.constexpr, TOP: tl.constexpr, MAPPED: tl.constexpr):
        """One row: the best k of its chunks' candidates, minus the row's log-partition; with MAPPED each
        column's token id from TokenIds."""
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS)
        top = tl.load(Stats + row * 2 * chunks + c, mask=c < chunks, other=float("-inf"))
        total = tl.load(Stats + (row * 2 + 1) * chunks + c, mask=c < chunks, other=0.0)
        high = tl.max(top, axis=0)
        log_partition = high + tl.log(tl.sum(total * tl.exp(top - high), axis=0))
        s = tl.arange(0, SPAN)
        key = tl.load(Candidates + row * chunks * TOP + s, mask=s < chunks * TOP, other=-9223372036854775807)
        best = tl.topk(key, TOP)
        j = tl.arange(0, TOP)
        tl.store(Logp + row * k + j, _key_score(best) - log_partition, mask=j < k)
        column = 2147483647 - (best & 0xFFFFFFFF)
        if MAPPED:
            column = tl.load(TokenIds + column, mask=j < k, other=0)
        tl.store(Tokens + row * k + j, column, mask=j < k)

    @triton.jit
    def _number_best_first(Scores, NodeOf, budget, n, MAX_DEPTH: tl.constexpr, EVERY: tl.constexpr,
                           NODES: tl.constexpr):
        """Number the kept slots of every depth best first (node r + 1 is the r-th best over all depths):
        NodeOf[slot] = its node. Returns each node's rank r, whether it exists, and its slot."""
        e = tl.arange(0, EVERY)
        inside = e < MAX_DEPTH * budget
        lowest = -9223372036854775807
        key = tl.where(inside, _key(tl.load(Scores + e, mask=inside, other=float("-inf")), EVERY - 1 - e), lowest)
        best = tl.topk(key, NODES)
        r = tl.arange(0, NODES)
        take = r < n
        cand = EVERY - 1 - (best & 0xFFFFFFFF)
        tl.store(NodeOf + cand, (r + 1).to(tl.int64), mask=take)
        tl.debug_barrier()
        return r, take, cand

    @triton.jit
    def _ancestor_matrix(Visible, Parents, n, ROWS: tl.constexpr, MAX_DEPTH: tl.constexpr):
        """Visible[i, j] = 1 for every ancestor j of node i and itself (the matrix zeroed by the caller): each
        row walks up from its node to the root through Parents, a built tree's."""
        i = tl.arange(0, ROWS)
        on = i < n + 1
        up = i.to(tl.int64)
        one = tl.full([ROWS], 1, tl.uint8)
        tl.store(Visible + i * (n + 1) + up, one, mask=on)
        for _ in range(MAX_DEPTH):
            up = tl.load(Parents + up, mask=on, other=0)
            tl.store(Visible + i * (n + 1) + up, one, mask=on)

    @triton.jit
    def _tree_kernel(Logp, Tok, Pairs, Scores, Picks, NodeOf, Tokens, NodeScores, Parents, Depths, Visible,
                     num_pairs, k, budget, n, MAX_DEPTH: tl.constexpr, SPAN: tl.constexpr, BUDGET: tl.constexpr,
                     EVERY: tl.constexpr, NODES: tl.constexpr, ROWS: tl.constexpr):
        """The PyTorch path of top_prefixes, step for step, for block program_id(0) of a batch. Selection keys
        carry the complement of an index in their low bits, so one descending integer top-k breaks score ties
        like a stable sort does."""
        block = tl.program_id(0).to(tl.int64)
        Logp += block * MAX_DEPTH * k
        Tok += block * MAX_DEPTH * k
        Scores += block * MAX_DEPTH * budget
        Picks += block * MAX_DEPTH * budget
        NodeOf += block * MAX_DEPTH * budget
        Tokens += block * n
        NodeScores += block * n
        Parents += block * (n + 1)
        Depths += block * (n + 1)
        Visible += block * (n + 1) * (n + 1)
        lowest = -9223372036854775807
        b = tl.arange(0, BUDGET)
        keep = b < budget
        tl.store(Scores + b, tl.load(Logp + b, mask=b < k, other=float("-inf")), mask=keep)  # depth 0
        tl.store(Picks + b, (b % k).to(tl.int64), mask=keep)
        f = tl.arange(0, SPAN)
        valid = f < num_pairs
        pair = tl.load(Pairs + f, mask=valid, other=0)
        slot, token = pair // k, pair % k
        tl.debug_barrier()
        for d in range(1, MAX_DEPTH):  # the best `budget` frontier extensions of depth d-1's slots
            cand = tl.load(Scores + (d - 1) * budget + slot, mask=valid, other=float("-inf"))
            cand += tl.load(Logp + d * k + token, mask=valid, other=float("-inf"))
            top = tl.topk(tl.where(valid, _key(cand, SPAN - 1 - f), lowest), BUDGET)
            tl.store(Scores + d * budget + b, _key_score(top), mask=keep)
            index = SPAN - 1 - (top & 0xFFFFFFFF)
            tl.store(Picks + d * budget + b, tl.load(Pairs + index, mask=keep, other=0), mask=keep)
            tl.debug_barrier()
        r, take, cand = _number_best_first(Scores, NodeOf, budget, n, MAX_DEPTH, EVERY, NODES)
        depth = cand // budget
        pick = tl.load(Picks + cand, mask=take, other=0)
        parent = tl.load(NodeOf + (depth - 1) * budget + pick // k, mask=take & (depth > 0), other=0)
        parent = tl.where((parent >= 1) & (parent <= r), parent, 0)  # a parent always precedes its child
        tl.store(Tokens + r, tl.load(Tok + depth * k + pick % k, mask=take, other=0), mask=take)
        tl.store(NodeScores + r, tl.load(Scores + cand, mask=take, other=float("-inf")), mask=take)
        tl.store(Parents + 1 + r, parent, mask=take)
        tl.store(Depths + 1 + r, depth + 1, mask=take)
        tl.store(Parents + r, tl.zeros_like(parent), mask=r == 0)  # the root
        tl.store(Depths + r, tl.zeros_like(depth), mask=r == 0)
        tl.debug_barrier()
        _ancestor_matrix(Visible, Parents, n, ROWS, MAX_DEPTH)


def chain(draft_logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Linear DFlash on the device: the argmax token at every depth (column c being token token_ids[c] when
    given), each node the child of the one before (so each sees every node up to itself)."""
    n = draft_logits.shape[0] + 1
    steps = torch.arange(n, device=draft_logits.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=draft_logits.device).tril()
    best = vocab_argmax(draft_logits)
    return best if token_ids is None else token_ids[best], (steps - 1).clamp(min=0), steps, causal


def ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """bool [..., N, N]: row i holds i and its ancestors (transitive closure of the parent edge by squaring), for
    parents [N] or a batch of trees' [..., N]."""
    n = parents.shape[-1]
    reach = torch.eye(n, device=parents.device).expand(*parents.shape, n).clone()
    ones = torch.ones((*parents.shape, 1), device=parents.device)  # no host scalar: capturable
    reach.scatter_(-1, parents[..., None], ones)
    for _ in range(max(max_depth, 1).bit_length()):
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0


@probe
def _smoke_test(device: torch.device) -> None:
    """A vocabulary top-2 and argmax, and a budget-2 tree."""
    logp, tokens = _vocab_top_on_gpu(torch.zeros(3, 20, device=device), 2, torch.arange(20, device=device))
    _vocab_argmax_on_gpu(torch.zeros(3, 20, device=device), 16)
    _build_on_gpu(logp, tokens, _frontier(2, 2, device), budget=2, n=2)
