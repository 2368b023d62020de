"""Shared cases for the kernel tests: each builds random inputs, runs a kernel and checks it against its
PyTorch reference, so the same check runs compiled on a GPU and interpreted on a CPU."""


import numpy as np
import torch
from ddtree.kernels import jit


def paired_projection_case(rows: int, n1: int, n2: int, k: int, fp8: bool, device: str) -> None:
    """A draft layer's q and k/v in one launch (gemm.pair_linear, float32 or fp8 operands): each side equals the
    float64 product with its own weight, and a second launch repeats it bit for bit."""
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels import gemm

    gen = torch.Generator().manual_seed(n1 + n2 + k)
    dense = [torch.randn(n, k, generator=gen).to(device) for n in (n1, n2)]
    x = torch.randn(rows, k, generator=gen).to(device)
    if fp8:
        weights = [quantize.quantize_weight(w) for w in dense]
        xq, xs = quantize.quantize_rows(x)
        given = quantize.QuantizedRows(xq, xs, torch.float32)
        want = [(xq.double() @ w.data.double().T) * (xs.double()[:, None] * w.scale.double()[None, :]) for w in weights]
    else:
        weights, given = dense, x
        want = [x.double() @ w.double().T for w in weights]
    got = gemm.pair_linear(given, *weights)
    assert got is not None and got.shape == (rows, n1 + n2)
    want = torch.cat(want, dim=1)
    error = ((got.double() - want).norm() / want.norm()).item()
    assert error < (5e-4 if fp8 else 1e-5), error  # float32: a 4096-long sum's rounding, as the skinny test allows
    assert torch.equal(gemm.pair_linear(given, *weights), got)
    assert not gemm._counters(x.device, 1).any()


def attention_case(n: int, groups: int, d: int, capacity: int, start: int, window: int | None):
    """Random grouped queries and cache (CPU, float32) over a random tree of n nodes, and SDPA's output for them."""
    from ddtree.kernels.attention import tree_attention, tree_mask

    gen = torch.Generator().manual_seed(n)
    kv_heads = 2
    q = torch.randn(kv_heads, groups * n, d, generator=gen)
    cache = torch.randn(2, kv_heads, capacity, d, generator=gen)
    parents = [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=gen))) for i in range(n)]
    visible = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):  # a random tree: each row sees itself and its parent's ancestors
        visible[i] |= visible[parents[i]]
    want = tree_attention(q, cache, tree_mask(torch.tensor(start), visible, capacity, groups, d, torch.float32, window))
    return q, cache, visible, want


def gemv_case(n: int, k: int, mode: str, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused GEMV's output for a random row in `mode` (plain, norm, norm_first, silu) and the float64
    product of the row its unfused steps make; the summed residual is checked bit for bit on the way, and
    in the norm modes so is `norm_gemv`'s output, with the normed row it hands back."""
    import torch.nn.functional as F
    from ddtree.kernels.gemv import NORM, PLAIN, SILU, gemv, norm_gemv
    from ddtree.models.draft import rms_norm

    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) / 32).to(dtype).to(device)
    width = 2 * k if mode == "silu" else k
    x, delta = ((torch.randn(1, width, generator=gen) * 3).to(dtype).to(device) for _ in range(2))
    norm = (torch.rand(width, generator=gen) + 0.5).to(dtype).to(device)
    if mode == "plain":
        row, (y, _) = x, gemv(x, weight, PLAIN)
    elif mode == "silu":
        gate, up = x.chunk(2, dim=-1)
        row, (y, _) = F.silu(gate) * up, gemv(x, weight, SILU)
    else:
        summed = x + delta if mode == "norm" else x
        row = rms_norm(summed, norm, 1e-6)
        y, residual = gemv(x, weight, NORM, delta if mode == "norm" else None, norm, 1e-6)
        assert torch.equal(residual, summed)
        again, residual, built = norm_gemv(x, weight, delta if mode == "norm" else None, norm, 1e-6)
        assert torch.equal(again, y) and torch.equal(residual, summed)
        assert torch.allclose(built, row, atol=0, rtol=2 ** -7)  # up to the sum of squares' order: one bf16 ulp
    return y.double(), F.linear(row.double(), weight.double())


def rows_case(n: int, width: int, dtype: torch.dtype, device: str) -> None:
    """The multi-row steps between a tree's GEMMs (ddtree/kernels/rows.py: RMSNorm, the residual add + RMSNorm of
    row-strided inputs, as slices of a wider GEMM output come, and SiLU · up) against the PyTorch functions the
    reference path runs: the same values up to the float32 sum's order and 1/sqrt, so within one rounding
    step of the dtype (the add, one rounding either way, bit for bit)."""
    from ddtree.fast.layers import add_rms_norm, silu_mul
    from ddtree.kernels import rows
    from ddtree.models.draft import rms_norm

    gen = torch.Generator().manual_seed(n + width)
    x = (torch.randn(n, width + 16, generator=gen) * 3).to(dtype).to(device)[:, :width]
    delta = (torch.randn(n, width, generator=gen) * 3).to(dtype).to(device)
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype).to(device)
    gate_up = (torch.randn(n, 2 * width + 8, generator=gen) * 4).to(dtype).to(device)[:, :2 * width]
    assert rows.supported(x, weight) and rows.supported(gate_up)
    assert not rows.supported(x.double(), weight) and not rows.supported(x, weight.double())
    step = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=2 ** -7)
    torch.testing.assert_close(rows.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **step)
    (got, got_sum), (want, want_sum) = (f(x, delta, weight, 1e-6) for f in (rows.add_rms_norm, add_rms_norm))
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got, want, **step)
    torch.testing.assert_close(rows.silu_mul(gate_up), silu_mul(gate_up), **step)


def argmax_case(rows: int, vocab: int, dtype: torch.dtype, device: str, chunk: int | None = None) -> None:
    """The verify's greedy picks (ddtree/kernels/tree.py: vocab_argmax) are torch.argmax's: the lowest token among
    tied maxima (ties within a chunk and across chunks, -0.0 with +0.0), a NaN above every number (+NaN or
    -NaN, the first one wins), and token 0 for a row of -inf (a grammar that allows nothing)."""
    from ddtree.kernels.tree import ARGMAX_CHUNK, _vocab_argmax_on_gpu

    chunk = chunk or ARGMAX_CHUNK
    logits = distinct_logits(rows, vocab, seed=vocab).div(2).round() + 0.0  # a handful of values: many ties
    logits[0, chunk - 1] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie between chunks (the lower wins)
    logits[1, vocab // 2] = float("nan")
    logits[1, vocab - 1] = -float("nan")
    logits[2] = -float("inf")
    logits[3, vocab - 1] = float("inf")  # the last token, in a chunk cut short by the vocabulary's end
    logits[4] = -1.0
    logits[4, 3], logits[4, 7] = -0.0, 0.0  # equal maxima: the lower token, whatever their signs
    logits = logits.to(dtype).to(device)
    got = _vocab_argmax_on_gpu(logits, chunk)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[:5].tolist() == [chunk - 1, vocab // 2, 0, vocab - 1, 3]


def sample_case(rows: int, vocab: int, dtype: torch.dtype, device: str, chunk: int | None = None) -> None:
    """The device round's picks (ddtree/kernels/tree.py: vocab_sample): a row at temperature 0 picks what
    vocab_argmax picks (ties, NaN and -inf rows included); rows at temperature 0.7 sample softmax(logits / 0.7)
    (chi-square over the tokens expected 5 times or more, the rest pooled), the same draws for the same seed and
    others for another; with a floor at each row's third-best logit, the softmax of its best three."""
    from ddtree.kernels.tree import ARGMAX_CHUNK, _vocab_argmax_on_gpu, _vocab_sample_on_gpu
    from scipy.stats import chisquare

    chunk = chunk or ARGMAX_CHUNK
    greedy = distinct_logits(5, vocab, seed=vocab).div(2).round() + 0.0
    greedy[1, vocab // 2] = float("nan")
    greedy[2] = -float("inf")
    greedy[3, chunk - 1] = greedy[3, vocab - 1] = greedy[3].max() + 1
    shared = (torch.randn(vocab, generator=torch.Generator().manual_seed(rows)) * 2).expand(rows, vocab)
    logits = torch.cat([greedy, shared]).to(dtype).to(device)
    temperature = torch.cat([torch.zeros(5), torch.full((rows,), 0.7)]).to(device)
    seed = torch.tensor([20261206], device=device)
    scaled = logits[5].float() / 0.7
    third = logits[5].float().topk(3).values[-1]
    floor = torch.cat([torch.zeros(5, device=device), third.expand(rows)])

    def fits(picks: torch.Tensor, probs: torch.Tensor) -> None:
        probs = probs.double().cpu().numpy()
        counts = np.bincount(picks.cpu().numpy(), minlength=vocab)
        common, rare = probs * len(picks) >= 5, (probs * len(picks) < 5) & (probs > 0)
        assert counts[probs == 0].sum() == 0
        observed = np.append(counts[common], counts[rare].sum())
        expected = np.append(probs[common], probs[rare].sum() + 1e-12) * len(picks)
        assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-4

    got = _vocab_sample_on_gpu(logits, temperature, seed, None, chunk)
    assert torch.equal(got[:5], _vocab_argmax_on_gpu(logits[:5], chunk))
    assert torch.equal(got[:30], _vocab_sample_on_gpu(logits[:30], temperature[:30], seed, None, chunk))
    assert not torch.equal(got[5:30], _vocab_sample_on_gpu(logits[:30], temperature[:30], seed + 1, None, chunk)[5:])
    fits(got[5:], torch.softmax(scaled.double(), dim=-1))
    filtered = _vocab_sample_on_gpu(logits, temperature, seed, floor, chunk)
    assert torch.equal(filtered[:5], got[:5])
    fits(filtered[5:], torch.softmax(torch.where(logits[5].float() >= third, scaled.double(), float("-inf")), dim=-1))


def compaction_case(path: list[int], start: int, dtype: torch.dtype, device: str) -> None:
    """The commit's in-place compaction of a [L, 2, kv, T, d] cache (ddtree/kernels/cache.py) moves exactly the
    path's rows to start.., bit for bit, and touches no other row, where the path reads rows that it also
    overwrites (its nodes lie deeper than their depths)."""
    from ddtree.kernels.cache import compact

    gen = torch.Generator().manual_seed(len(path) + start)
    cache = torch.randn(3, 2, 2, 64, 16, generator=gen).to(dtype).to(device)
    want = cache.clone()
    for i, node in enumerate(path):  # from the untouched copy: every source read before any row is written
        want[..., start + i, :] = cache[..., start + node, :]
    compact(cache, torch.tensor(start, device=device), torch.tensor(path, device=device))
    assert torch.equal(cache, want)


def walk_case(budget: int, accept_depth: int, seed: int, device: str) -> None:
    """The acceptance walk's kernel (ddtree/kernels/walk.py) gives the PyTorch steps' result, path, length and bonus,
    and both give what walking the tree from the root gives: at each node, the child whose token is the target's
    pick there. The picks accept a path of `accept_depth` nodes below the root (fewer when the tree is shallower),
    and pick tokens no child holds elsewhere, so the walk must stop where the path ends."""
    from ddtree.kernels.tree import top_prefixes
    from ddtree.kernels.walk import _accept_kernel, accept_torch

    gen = torch.Generator().manual_seed(seed)
    max_depth, vocab = 15, 40
    tokens, parents, depths, visible = top_prefixes(torch.randn(max_depth, vocab, generator=gen) * 3, budget)
    ids = torch.cat([torch.tensor([7]), tokens])
    n = ids.numel()
    children = {node: [c for c in range(1, n) if parents[c] == node] for node in range(n)}
    picks = torch.randint(vocab, 2 * vocab, (n,), generator=gen)  # no node holds these tokens
    node = 0
    for _ in range(accept_depth):
        if not children[node]:
            break
        child = children[node][int(torch.randint(len(children[node]), (1,), generator=gen))]
        picks[node], node = ids[child], child
    walked = [0]
    while (nxt := [c for c in children[walked[-1]] if ids[c] == picks[walked[-1]]]):
        walked.append(nxt[0])
    want_path = walked + [0] * (max_depth + 1 - len(walked))
    want = (torch.tensor([len(walked), *picks[want_path].tolist()]), torch.tensor(want_path),
            torch.tensor(len(walked)), picks[walked[-1]])
    on = [t.to(device) for t in (ids, picks, parents, depths, visible)]
    for got in (accept_torch(*on, max_depth), _accept_kernel(*on, max_depth)):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.cpu(), w), (g, w)


def quantized_rows_case(n: int, width: int, dtype: torch.dtype, device: str, group: int | None = None) -> None:
    """An fp8 drafter's or target's norms and SiLU · up write their rows quantized (one scale per row, or per
    `group` columns), in one kernel each: the same bits as the plain row kernel followed by the row quantization
    kernel (and, on a GPU, torch's quantize_rows), for row-strided inputs, as slices of a wider GEMM output come.

    Except float32 rows on a GPU: there the compiled norm kernel with the quantization in it may sum a row's squares
    in another order than the plain one, so its 1 / rms can be an ulp apart, and with it the scale (bf16 rounding
    hides that ulp). Those rows are held to the plain ones within e4m3's rounding."""
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels import rows

    gen = torch.Generator().manual_seed(n + width)
    x = (torch.randn(n, width + 64, generator=gen) * 3).to(dtype).to(device)[:, :width]
    delta = (torch.randn(n, width, generator=gen) * 3).to(dtype).to(device)
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype).to(device)
    gate_up = (torch.randn(n, 2 * width + 64, generator=gen) * 4).to(dtype).to(device)[:, :2 * width]
    quantizers = [rows.quantize] + ([quantize.quantize_rows] if device == "cuda" else [])

    def same(got: quantize.QuantizedRows, plain: torch.Tensor) -> None:
        assert got.dtype == dtype and got.group == group
        if dtype == torch.float32 and device == "cuda":
            want_scale = quantize.quantize_rows(plain, group)[1]
            torch.testing.assert_close(got.scale, want_scale, rtol=1e-6, atol=0.0)
            scale = dequantized_rows(torch.ones_like(got.values, dtype=torch.float32), got.scale, group)
            error = (got.values.double() * scale - plain.double()).abs()
            # half an e4m3 step: 2^-4 of a normal value, 2^-10 of the scale below e4m3's normals (2^-6)
            assert (error <= (plain.abs().double() * 2**-4 + scale * 2**-10) * (1 + 1e-5)).all()
            return
        for quantizer in quantizers:
            values, scale = quantizer(plain, group)
            assert torch.equal(got.scale, scale)
            assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))

    normed, residual = rows.rms_norm_fp8(x, None, weight, 1e-6, group)
    same(normed, rows.rms_norm(x, weight, 1e-6))
    assert residual is x
    (normed, summed), (plain, want_sum) = (rows.rms_norm_fp8(x, delta, weight, 1e-6, group),
                                           rows.add_rms_norm(x, delta, weight, 1e-6))
    same(normed, plain)
    assert torch.equal(summed, want_sum)
    same(rows.silu_mul_fp8(gate_up, group), rows.silu_mul(gate_up))


def gdn_module(heads: int, k_heads: int, d: int, dtype: torch.dtype, device: str, seed: int) -> torch.nn.Module:
    """A random Qwen3.5 Gated DeltaNet layer (hidden 64, conv width 4) with its input projections fused as the
    fast path fuses them (`ddtree_in_proj`), and gates and norm weights away from zero."""
    from ddtree.fast.layers import fuse
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=k_heads, linear_num_value_heads=heads,
                               linear_key_head_dim=d, linear_value_head_dim=d, linear_conv_kernel_dim=4)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for p in (module.A_log, module.dt_bias, module.norm.weight):
            p.uniform_(0.2, 1.2)
    module = module.to(device, dtype)
    fuse(module, "ddtree_in_proj", [module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a])
    return module


def gdn_case(heads: int, k_heads: int, d: int, dtype: torch.dtype, device: str, nodes: int = 1) -> tuple[tuple, tuple]:
    """A random Qwen3.5 Gated DeltaNet layer over a random tree of `nodes` (one: an AR step): the kernel's
    (output, conv window columns, keys, u, G) and the same from the PyTorch steps it replaces (the conv and
    gates over each node's window, the closed-form delta rule, the gated norm)."""
    from ddtree.fast.delta import conv_sources, tree_delta_rule
    from ddtree.fast.hybrid import conv_and_gates, gated_rms_norm
    from ddtree.kernels import gdn
    from ddtree.models.hybrid import split_heads
    from trees import ancestry, random_tree

    module = gdn_module(heads, k_heads, d, dtype, device, heads + d + nodes)
    assert gdn.takes(module)
    conv_dim, taps = module.conv_dim, module.conv_kernel_size
    visible, depths = ancestry(random_tree(nodes, torch.default_generator))  # (the seed above draws it)
    visible, sources = visible.to(device), conv_sources(visible, depths, taps).to(device)
    proj = torch.randn(nodes, conv_dim + module.value_dim + 2 * heads, device=device).to(dtype)
    conv_state = torch.randn(taps - 1, conv_dim, device=device).to(dtype)
    state = torch.randn(heads, d, d, device=device) / d
    got = (torch.empty(taps - 1 + nodes, conv_dim, device=device, dtype=dtype),
           torch.empty(nodes, heads, d, device=device), torch.empty(nodes, heads, d, device=device),
           torch.empty(nodes, heads, device=device))
    if nodes == 1:
        out = gdn.row_step(module, proj, conv_state, state, *got)
    else:
        out = gdn.tree_step(module, proj, conv_state, state, got[0], sources, visible, *got[1:])
    qkv, z, b, a = proj.split([conv_dim, module.value_dim, heads, heads], dim=-1)
    if nodes > 1:  # the tree kernels stop before the gated norm: the fast path's compiled norm follows them
        out = gated_rms_norm(out.view(-1, d), z.reshape(-1, d), module.norm.weight,
                             module.norm.variance_epsilon).view(nodes, -1)
    inputs = torch.cat([conv_state, qkv])
    window = inputs[sources].transpose(1, 2)
    # the conv summed in float32 and rounded once, as the compiled step and the kernels do (eager bf16 would
    # round every product, a difference the tree's triangular solve amplifies)
    conv, beta, g = conv_and_gates(window.float(), module.conv1d.weight[:, 0].float(), b, a, module.A_log,
                                   module.dt_bias)
    conv = conv.to(dtype)
    o, keys, u, decay = tree_delta_rule(*split_heads(module, conv), g, beta, visible, state)
    want = gated_rms_norm(o.to(dtype).reshape(-1, d), z.reshape(-1, d), module.norm.weight,
                          module.norm.variance_epsilon).reshape(nodes, -1)
    return (out, *got), (want, inputs, keys, u, decay)


def distinct_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits without ties (each row a permutation of an even grid): tie order is left to each top-k."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]).float() * (12 / vocab) - 6


class SmallGPU:
    """A Triton kernel on a GPU with little shared memory: a launch whose constexpr tile or pipeline depth is
    over `limits` fails as Triton's does (OutOfResources, before any work); the others run the real kernel."""

    def __init__(self, kernel, limits: dict[str, int]) -> None:
        self.kernel, self.limits, self.tried = kernel, limits, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tried.append({name: kwargs[name] for name in self.limits})
            if any(kwargs[name] > limit for name, limit in self.limits.items()):
                raise jit.OutOfResources(1, 0, "shared memory")
            return self.kernel[grid](*args, **kwargs)
        return launch


def integer_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """e4m3 values that are integers in [-16, 16] (exact in e4m3): sums of their products stay exact in float32
    in any order (below 2^24 for K up to 65536), so kernels and references can be compared bit for bit."""
    return torch.randint(-16, 17, shape, generator=gen).float().to(torch.float8_e4m3fn)


def dequantized_rows(values: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    """Quantized rows [M, K] as the float64 values they stand for: per-row scales [M], or one per `group`
    columns [M, K / group]."""
    if group is None:
        return values.double() * scale.double()[:, None]
    return values.double() * scale.double().repeat_interleave(group, dim=1)[:, :values.shape[1]]


def block_scaled_case(rows: int, n: int, k: int, block_rows: int, device: str) -> None:
    """The fp8 few-row GEMM on a block-scaled weight (the published 128 x 128 blocks, or each row's own K-block
    scales) and rows with one scale per 128-column group (W8A8 block FP8) equals fp8.reference_mm bit for bit and
    the float64 product of the dequantized operands (fp8.dequantize: the scales are powers of two, so every step is
    exact), and repeats bit for bit."""
    from ddtree.kernels import fp8, gemm

    gen = torch.Generator().manual_seed(rows + n + k + block_rows)
    scale = 2.0 ** torch.randint(-10, -4, (-(-n // block_rows), k // 128), generator=gen).float()
    weight = fp8.Fp8Weight(integer_fp8((n, k), gen).to(device), scale.to(device), (block_rows, 128))
    values = integer_fp8((rows, k), gen).to(device)
    row_scale = (2.0 ** torch.randint(-6, 0, (rows, k // 128), generator=gen).float()).to(device)
    given = fp8.QuantizedRows(values, row_scale, torch.float32, 128)
    got = gemm.skinny_fp8(values, row_scale, weight, torch.float32)
    assert torch.equal(got, fp8.reference_mm(given, weight))
    dense = dequantized_rows(values, row_scale, 128) @ fp8.dequantize(weight).double().T
    assert torch.equal(got.double(), dense)
    assert torch.equal(gemm.skinny_fp8(values, row_scale, weight, torch.float32), got)
    assert not gemm._counters(values.device, 1).any()
