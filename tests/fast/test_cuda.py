"""On a GPU: the compiled steps replayed as CUDA graphs give the reference path's tokens.

These run where CUDA is (the GPU machine: `pytest tests/fast/test_cuda.py`); CI has no GPU.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.fast import layers
from ddtree.kernels.heads import attention_heads as heads_kernel
from ddtree.kernels.jit import triton_works
from ddtree.switches import override

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.mark.parametrize(("arch", "draft"), [("qwen3", "draft"), ("llama", "draft"), ("qwen3", "draft_swa")])
def test_graphs_and_compiled_steps_give_the_reference_tokens(fast_ckpt, arch, draft):
    fast = Engine.from_pretrained(fast_ckpt / arch, fast_ckpt / draft, device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert fast.fast.ops.compiled and triton_works(fast.fast.device)  # the Triton kernels, not their fallbacks
    assert fast.fast.row_gemv  # AR steps through the fused GEMVs
    assert fast.fast.ops.attention_heads is heads_kernel
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            rounds = list(gen)
            ref = reference.stream(prompt, GREEDY, method=method, budget=budget)
            ref_rounds = list(ref)
            plan = fast.fast.plan(method, budget or 1)
            assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
            assert gen.token_ids == ref.token_ids, (method, budget)
            assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds]


def test_a_draft_vocabulary_replays_as_graphs_and_gives_the_reference_tokens(fast_ckpt):
    hot = list(range(0, 96, 3))  # every third token: the trees must map draft columns back to token ids
    fast = Engine(*_loaded(fast_ckpt), fast=True, fast_capacity=256, draft_vocab=hot)
    reference = Engine(fast.target, fast.draft, fast.tokenizer, draft_vocab=hot)
    ar = Engine(fast.target, fast.draft, fast.tokenizer)
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        want = ar.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            rounds = list(gen)
            ref = reference.stream(prompt, GREEDY, method=method, budget=budget)
            ref_rounds = list(ref)
            assert gen.on_fast_path and fast.fast.plan(method, budget or 1).graphs
            assert gen.token_ids == ref.token_ids == want, (method, budget)
            assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_draft_replays_as_graphs_and_gives_the_targets_tokens(fast_ckpt, dtype):
    """fp8 drafter projections in the round's graphs: the output is the reference path's `ar`, and both paths
    draft with fp8 (the fast path through the kernels, the reference through them too on CUDA)."""
    from ddtree.kernels.fp8 import Fp8Weight

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=256, draft_quantization="fp8")
    reference = Engine(fast.target, fast.draft, fast.tokenizer, draft_vocab=fast.draft_head,
                       draft_quantization="fp8")
    assert isinstance(fast.fast.fused_draft.layers[0].q.weight, Fp8Weight)
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        want = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 16), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            list(gen)
            assert gen.on_fast_path and fast.fast.plan(method, budget or 1).graphs
            if gen.token_ids != want:  # bf16 only, and at a near-tie of the reference (graph_rounds_match_ar)
                assert dtype != "float32", (method, budget)
                assert reference_margin(reference, prompt, want, gen.token_ids) < NEAR_TIE, (method, budget)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k"), [(1, 64), (16, 4096), (16, 12288), (300, 20480)])
def test_the_row_quantization_kernel_equals_torchs_cast_bit_for_bit(dtype, rows, k):
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels.rows import quantize as quantize_kernel

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, k, device="cuda", generator=gen) * 3).to(dtype)
    x[0, :7] = 0.0
    q, scale = quantize_kernel(x)
    want_q, want_scale = quantize.quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize(("rows", "n", "k"), [(16, 4096, 4096), (16, 2048, 4096), (16, 24576, 4096),
                                              (16, 4096, 12288), (16, 4096, 20480), (16, 16384, 4096),
                                              (3, 40, 64), (200, 10240, 4096)])
def test_the_fp8_gemm_equals_a_float64_product_of_its_operands_and_repeats_bit_for_bit(rows, n, k):
    """The draft's widths (q, k/v, gate/up, down, fc, a draft vocabulary's head; a prompt's context rows in row
    tiles). Each K tile's product is added in float32 (Hopper's fp8 MMA adds in fewer bits than float32)."""
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels import gemm

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    gen = torch.Generator(device="cuda").manual_seed(n + rows)
    weight = quantize.quantize_weight(torch.randn(n, k, device="cuda", generator=gen))
    xq, xs = quantize.quantize_rows(torch.randn(rows, k, device="cuda", generator=gen))
    want = (xq.double() @ weight.data.double().T) * (xs.double()[:, None] * weight.scale.double()[None, :])
    got = gemm.skinny_fp8(xq, xs, weight, torch.float32)
    error = ((got.double() - want).norm() / want.norm()).item()
    assert error < 5e-4, error
    assert torch.equal(gemm.skinny_fp8(xq, xs, weight, torch.float32), got)
    bf16 = gemm.skinny_fp8(xq, xs, weight, torch.bfloat16)
    assert torch.allclose(bf16.float(), got, rtol=1e-2, atol=1e-2 * want.abs().max().item())


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


@pytest.mark.parametrize("fp8", [False, True])
def test_a_draft_layers_q_and_kv_in_one_launch_equal_their_own_products(fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    paired_projection_case(16, 4096, 2048, 4096, fp8, "cuda")


def _loaded(fast_ckpt: Path) -> tuple:
    """The float32 qwen3 pair on CUDA: (target, draft, tokenizer)."""
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32")
    return engine.target, engine.draft, engine.tokenizer


def test_the_fast_path_is_on_by_default_on_cuda(fast_ckpt):
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", fast=None)
    assert engine.fast is not None and engine.stream([1, 2, 3], GREEDY).on_fast_path


def test_without_triton_the_graphs_still_give_the_reference_tokens(fast_ckpt, monkeypatch):
    """A machine whose Triton cannot build kernels (no compiler) serves on SDPA and the PyTorch tree loop."""
    from ddtree.kernels import jit

    monkeypatch.setattr(jit, "_WORKS", {torch.device("cuda", torch.cuda.current_device()): False})
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32",
                                  fast=True, fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    for method, budget in (("dflash", None), ("ddtree", 16)):
        gen = fast.stream(list(range(60, 90)), GREEDY, method=method, budget=budget)
        list(gen)
        ref = reference.stream(list(range(60, 90)), GREEDY, method=method, budget=budget)
        list(ref)
        assert gen.on_fast_path and fast.fast.plan(method, budget or 1).graphs
        assert gen.token_ids == ref.token_ids, method


def test_dependent_launches_change_no_bits(fast_ckpt, monkeypatch):
    """On Hopper and later the Triton kernels launch as programmatic dependents: inside a graph each may start
    while the kernel before it drains, and waits for it before touching its outputs; a B = 64 tree's norms,
    heads and attention kernels let the next kernel launch before they wait (wgmma.early_pdl). The same rounds
    with early launches off, and with PDL off, give the same tokens and log-probabilities, bit for bit; a kernel
    that read another's output before its wait would race, and round AR steps (all Triton) and trees
    differently."""
    from ddtree.kernels import jit, wgmma

    if not jit.pdl(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("no programmatic dependent launch on this GPU or Triton")
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="bfloat16",
                                    fast=True, fast_capacity=256)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)

    def decode() -> list:
        engine.fast._plans.clear()  # recaptured with the current launches
        out = []
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 64)):
            gen = engine.stream(list(range(60, 90)), params, method=method, budget=budget)
            out.append([(r.token_ids, r.logprobs) for r in gen])
        return out

    assert wgmma.EARLY_STEPS
    dependent = decode()
    monkeypatch.setattr(wgmma, "EARLY_STEPS", frozenset())
    assert decode() == dependent
    with override(pdl=False):
        assert decode() == dependent


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "groups", "window", "d"),
                         [(1, 4, None, 64), (17, 4, None, 64), (65, 2, None, 64), (16, 4, 24, 64), (300, 1, None, 64),
                          (65, 6, None, 256)])
def test_triton_tree_attention_matches_sdpa(dtype, n, groups, window, d):
    """Head dim 256 with 390 grouped rows (a Qwen3.6-27B prompt chunk): in float32 the tuned tiles need more
    shared memory than an H200 has, so the launch must shrink them (attention.launch_fitting)."""
    from ddtree.kernels.attention import tree_attention, tree_mask

    capacity, start = 512, 150
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, window)
    cuda = [t.cuda().to(dtype) for t in (q, cache)]
    mask = tree_mask(torch.tensor(start).cuda(), visible.cuda(), capacity, groups, d, dtype, window)
    assert mask.visible is not None  # the Triton kernel, not SDPA
    got = tree_attention(*cuda, mask).float().cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (got - want).abs().max()


TALL = dict(block_m=128, block_n=32, num_warps=8, num_stages=1)  # one tile holds all of a 65-node tree's rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "window"), [(1, None), (16, None), (65, None), (65, 24)])
@pytest.mark.parametrize("tile", [None, TALL], ids=["default", "tall"])
def test_one_split_writes_the_merged_output(dtype, n, window, tile):
    """With one split the split kernel normalises and writes the output itself (no merge pass): it must agree
    with the merged four-split kernel and with SDPA, padded tile rows included."""
    from ddtree.kernels.attention import _triton_attention, launch_config, tree_mask

    kv_heads, groups, d, capacity, start = 2, 4, 128, 768, 560
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, window)
    q, cache = (t.cuda().to(dtype) for t in (q, cache))
    mask = tree_mask(torch.tensor(start).cuda(), visible.cuda(), capacity, groups, d, dtype, window)
    assert mask.visible is not None  # the Triton kernel, not SDPA
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    cfg = {**launch_config(groups * n, capacity, kv_heads, sms), **(tile or {})}
    direct = _triton_attention(q, cache, mask, {**cfg, "splits": 1}).float().cpu()
    merged = _triton_attention(q, cache, mask, {**cfg, "splits": 4}).float().cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(direct, merged, atol=tolerance, rtol=tolerance), (direct - merged).abs().max()
    assert torch.allclose(direct, want, atol=tolerance, rtol=tolerance), (direct - want).abs().max()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (6144, 4096), (4096, 12288)])
@pytest.mark.parametrize("mode", ["plain", "norm", "norm_first", "silu"])
def test_one_row_gemv_equals_its_unfused_steps(dtype, n, k, mode):
    """The fused GEMV against the steps it replaces: the same input row (rounded where the reference rounds
    it), a float32 dot, one rounding at the end; the summed residual bit for bit."""
    y, want = gemv_case(n, k, mode, dtype, "cuda")
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (and rare input ties)
    assert torch.allclose(y, want, atol=tolerance, rtol=tolerance), (y - want).abs().max()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "width"), [(16, 4096), (65, 4096), (65, 5120), (129, 12288)])
def test_row_kernels_equal_the_reference_norms_and_silu(dtype, n, width):
    rows_case(n, width, dtype, "cuda")


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


def quantized_rows_case(n: int, width: int, dtype: torch.dtype, device: str) -> None:
    """An fp8 drafter's norms and SiLU · up write their rows quantized, in one kernel each: the same bits as the
    plain row kernel followed by the row quantization kernel (and, on a GPU, torch's quantize_rows), for row-strided
    inputs, as slices of a wider GEMM output come.

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
        assert got.dtype == dtype
        if dtype == torch.float32 and device == "cuda":
            want_scale = quantize.quantize_rows(plain)[1]
            torch.testing.assert_close(got.scale, want_scale, rtol=1e-6, atol=0.0)
            error = (got.values.float() * got.scale[:, None] - plain).abs()
            # half an e4m3 step: 2^-4 of a normal value, 2^-10 of the scale below e4m3's normals (2^-6)
            assert (error <= (plain.abs() * 2**-4 + got.scale[:, None] * 2**-10) * (1 + 1e-5)).all()
            return
        for quantizer in quantizers:
            values, scale = quantizer(plain)
            assert torch.equal(got.scale, scale)
            assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))

    normed, residual = rows.rms_norm_fp8(x, None, weight, 1e-6)
    same(normed, rows.rms_norm(x, weight, 1e-6))
    assert residual is x
    (normed, summed), (plain, want_sum) = rows.rms_norm_fp8(x, delta, weight, 1e-6), rows.add_rms_norm(x, delta,
                                                                                                       weight, 1e-6)
    same(normed, plain)
    assert torch.equal(summed, want_sum)
    same(rows.silu_mul_fp8(gate_up), rows.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(5, 151936), (65, 151936), (129, 151936), (16, 16384), (5, 4097)])
def test_the_argmax_kernels_equal_torchs_argmax(dtype, rows, vocab):
    argmax_case(rows, vocab, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("path", "start"), [([0, 2, 5, 9], 7), ([0, 1, 2], 0), (list(range(0, 32, 2)), 20)])
def test_the_compaction_kernel_moves_the_path_rows_in_place(dtype, path, start):
    compaction_case(path, start, dtype, "cuda")


@pytest.mark.parametrize(("budget", "accept_depth"), [(1, 1), (16, 0), (64, 3), (64, 15), (256, 6)])
def test_the_walk_kernel_accepts_the_path_the_picks_spell(budget, accept_depth):
    walk_case(budget, accept_depth, seed=budget + accept_depth, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "width"), [(16, 4096), (16, 12288), (300, 4096)])
def test_quantizing_row_kernels_equal_the_row_kernels_then_torchs_quantization(dtype, n, width):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    quantized_rows_case(n, width, dtype, "cuda")


def gdn_case(heads: int, k_heads: int, d: int, dtype: torch.dtype, device: str, nodes: int = 1) -> tuple[tuple, tuple]:
    """A random Qwen3.5 Gated DeltaNet layer over a random tree of `nodes` (one: an AR step): the kernel's
    (output, conv window columns, keys, u, G) and the same from the PyTorch steps it replaces (the conv and
    gates over each node's window, the closed-form delta rule, the gated norm)."""
    from ddtree.fast.delta import conv_sources, tree_delta_rule
    from ddtree.fast.hybrid import conv_and_gates, gated_rms_norm
    from ddtree.fast.layers import fuse
    from ddtree.kernels import gdn
    from ddtree.models.hybrid import split_heads
    from test_delta import ancestry, random_tree
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(heads + d + nodes)
    config = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=k_heads, linear_num_value_heads=heads,
                               linear_key_head_dim=d, linear_value_head_dim=d, linear_conv_kernel_dim=4)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for p in (module.A_log, module.dt_bias, module.norm.weight):
            p.uniform_(0.2, 1.2)
    module = module.to(device, dtype)
    fuse(module, "ddtree_in_proj", [module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "k_heads", "d"), [(4, 2, 16), (48, 16, 128)])
@pytest.mark.parametrize("nodes", [1, 17, 33, 65, 128])
def test_gated_deltanet_kernels_equal_the_pytorch_steps(dtype, heads, k_heads, d, nodes):
    """Qwen3.6-27B's widths (48 value heads over 16 key heads, d 128) and a tiny grouped case, for an AR step
    and trees up to TREE_MAX nodes: the kernels' outputs and commit record against the steps they replace.
    bf16: within the conv's and the norm's rounding."""
    got, want = gdn_case(heads, k_heads, d, dtype, "cuda", nodes)
    assert torch.equal(got[1], want[1])  # the conv window's columns, copied
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for name, g, w in zip(("out", "keys", "u", "decay"), got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert torch.allclose(g.float(), w.float(), atol=tolerance, rtol=tolerance), (name, (g.float() - w).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(2, 40, 64), (16, 4096, 4096), (17, 6144, 4096), (32, 4100, 12288),
                                              (15, 151936, 256), (65, 1000, 256)])
def test_skinny_gemm_equals_a_float64_product_and_repeats_bit_for_bit(dtype, rows, n, k):
    """The few-row GEMM (split-K partials summed by the last program of each column tile) against float64;
    two launches give the same bits (the arrival counters reset); `linear` takes it only up to MAX_ROWS."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm

    gen = torch.Generator().manual_seed(rows + n + k)
    weight = (torch.randn(n, k, generator=gen) / 32).to(dtype).cuda()
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype).cuda()
    want = F.linear(x.double(), weight.double())
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    y = gemm.skinny_linear(x, weight)
    assert y.dtype == dtype and torch.allclose(y.double(), want, atol=tolerance, rtol=tolerance)
    assert torch.equal(gemm.skinny_linear(x, weight), y)
    if k % 256 == 0:  # the split-K reduction, forced
        split = dict(block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=3)
        assert torch.allclose(gemm.skinny_linear(x, weight, split).double(), want, atol=tolerance, rtol=tolerance)
    assert gemm.supported(x, weight) == (rows <= gemm.MAX_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [33, 65, 128, 129])
def test_many_row_projections_go_through_cublaslt_and_equal_a_float64_product(monkeypatch, dtype, rows):
    """Without the wgmma kernel (not Hopper, or DDTREE_WGMMA=0), `linear` hands half-precision rows past the skinny
    kernel's, up to LT_MAX_ROWS, to cuBLASLt by way of a zero bias, and the product stays right; float32 and
    wider trees keep cuBLAS."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm

    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(6144, 4096, generator=gen) / 32).to(dtype).cuda()
    x = (torch.randn(rows, 4096, generator=gen) * 3).to(dtype).cuda()
    biases = []
    monkeypatch.setattr(gemm, "_zero_bias", lambda n, x: biases.append(n) or torch.zeros(n, dtype=x.dtype,
                                                                                          device=x.device))
    with override(wgmma=False):
        y = gemm.linear(x, weight)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), F.linear(x.double(), weight.double()), atol=tolerance, rtol=tolerance)
    assert biases == ([6144] if dtype == torch.bfloat16 and rows <= gemm.LT_MAX_ROWS else [])


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _fills_the_gpu(n: int, k: int, rows: int) -> bool:
    """The wgmma kernel's fill rule for an [n, k] weight at `rows` rows on this GPU."""
    from ddtree.kernels import wgmma

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return wgmma.fill(wgmma.launch_config(n, k, rows, sms), n, sms) >= wgmma.MIN_FILL


@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n", "k", "tiles"), [
    (65, 6144, 4096, None), (65, 4096, 12288, None), (65, 24576, 4096, None), (33, 4100, 4096, None),
    (129, 1000, 256, None), (136, 4096, 4096, None), (40, 200, 1024, (1, 2, 4)), (72, 384, 512, (3, 3, 1))])
def test_wgmma_gemm_equals_a_float64_product_and_repeats_bit_for_bit(dtype, rows, n, k, tiles):
    """The Hopper GEMM for a verify's rows against float64: rows padded to a multiple of 8 (zeros from TMA),
    weights whose rows end inside a tile, K split over blocks (the last one sums in split order), a stage ring
    that wraps; two launches give the same bits (the tickets reset), as do stages of one K box and of two, and
    `gemm.linear` routes these rows to it."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm, wgmma

    gen = torch.Generator().manual_seed(rows + n + k)
    weight = (torch.randn(n, k, generator=gen) / 32).to(dtype).cuda()
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype).cuda()
    config = None if tiles is None else wgmma.Config(tiles[0], wgmma.padded_rows(rows), tiles[1], tiles[2])
    y = wgmma.linear(x, weight, config)
    want = F.linear(x.double(), weight.double())
    assert y.dtype == dtype and torch.allclose(y.double(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(wgmma.linear(x, weight, config), y)
    used = config or wgmma.launch_config(n, k, rows, torch.cuda.get_device_properties(0).multi_processor_count)
    boxes = 1 if used.boxes > 1 else 2
    if (k // 64 // used.splits) % boxes == 0:
        stages = min(used.stages, wgmma.max_stages(used.consumers, used.bn, boxes))
        assert torch.equal(wgmma.linear(x, weight, dataclasses.replace(used, boxes=boxes, stages=stages)), y)
    if tiles is None:  # `gemm.linear` routes these rows to it, unless its blocks would leave many SMs idle
        assert wgmma.supported(x, weight) == _fills_the_gpu(n, k, rows)
        assert not wgmma.supported(x, weight) or torch.equal(gemm.linear(x, weight), y)


@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n", "k", "tiles"), [
    (65, 24576, 4096, None), (33, 6000, 1024, None), (129, 2000, 256, None), (136, 8192, 4096, None),
    (40, 400, 1024, (1, 2, 4)), (72, 768, 512, (3, 3, 1)), (65, 4096, 12288, None)])
def test_wgmma_silu_epilogue_equals_the_row_kernel_after_the_product(dtype, rows, n, k, tiles):
    """SiLU(gate) · up in the gate/up product's epilogue gives the bits of ddtree/kernels/rows.py's kernel run on the
    plain product: gate widths that end inside a block (3000 of 96 a block), K split over blocks, a stage ring that
    wraps; and `gemm.silu_mul_linear` takes these rows where the fill rule lets the kernel take the product."""
    from ddtree.kernels import gemm, wgmma
    from ddtree.kernels import rows as row_kernels

    gen = torch.Generator().manual_seed(rows + n + k)
    weight = (torch.randn(n, k, generator=gen) / 16).to(dtype).cuda()
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype).cuda()
    plain = None if tiles is None else wgmma.Config(tiles[0], wgmma.padded_rows(rows), tiles[1], tiles[2])
    want = row_kernels.silu_mul(wgmma.linear(x, weight, plain))
    if tiles is None:
        got = wgmma.silu_mul_linear(x, weight)
        assert wgmma.supported(x, weight) == _fills_the_gpu(n, k, rows)
        fused_act = gemm.silu_mul_linear(x, weight)
        assert fused_act is None if not _fills_the_gpu(n, k, rows) else torch.equal(fused_act, got)
    else:
        got = wgmma.linear(x, weight, dataclasses.replace(plain, glu=True))
    assert got.shape == (rows, n // 2) and want.abs().max() > 0.5
    assert torch.equal(got, want)


@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
def test_the_silu_epilogue_changes_no_bit_of_a_round(fast_ckpt, monkeypatch):
    """With the fill rule off, the tiny target's tree projections run on the Hopper GEMM, and its MLPs take SiLU · up
    in the gate/up product's epilogue: the same rounds with the row kernel after the plain product give the same
    tokens and log-probabilities, bit for bit."""
    from ddtree.kernels import gemm, wgmma

    monkeypatch.setattr(wgmma, "MIN_FILL", 0.0)
    folded = []

    def counted(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        act = gemm.silu_mul_linear(x, weight)
        if act is not None:
            folded.append(x.shape[0])
        return act

    monkeypatch.setattr(layers, "silu_mul_linear", counted)
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="bfloat16",
                                    fast=True, fast_capacity=256)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)

    def decode() -> list:
        engine.fast._plans.clear()  # recaptured with the current steps
        return [[(r.token_ids, r.logprobs) for r in engine.stream(list(range(60, 90)), params, method="ddtree",
                                                                 budget=budget)] for budget in (32, 64)]

    assert engine.fast.ops.folding_silu
    with_epilogue = decode()
    assert {33, 65} <= set(folded)
    engine.fast.ops.folding_silu = False
    folded.clear()
    assert decode() == with_epilogue and not folded


@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
def test_wgmma_gemm_in_a_graph_reads_what_the_kernel_before_it_wrote():
    """Captured after two Triton row kernels and launched as the second's programmatic dependent, the GEMM loads
    its first weight tiles early (at 65 rows the norms let it launch before they wait, so while the first norm
    may still run) but the rows only after the second is done: replays over new inputs give eager bits."""
    from ddtree.kernels import wgmma
    from ddtree.kernels.rows import rms_norm

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(4096, 4096, generator=gen) / 32).to(torch.bfloat16).cuda()
    norm = torch.rand(4096, generator=gen).to(torch.bfloat16).cuda() + 0.5
    x = torch.empty(65, 4096, dtype=torch.bfloat16, device="cuda")

    def step() -> torch.Tensor:
        return wgmma.linear(rms_norm(rms_norm(x, norm, 1e-6), norm, 1e-6), weight)

    x.copy_(torch.randn(65, 4096, generator=gen))
    step()  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        x.copy_(torch.randn(65, 4096, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, step())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "heads", "kv_heads", "d", "norm"),
                         [(1, 32, 8, 128, True), (65, 32, 8, 128, True), (16, 4, 2, 64, False), (3, 2, 2, 16, True)])
def test_attention_heads_kernel_equals_the_reference_step(dtype, n, heads, kv_heads, d, norm):
    """The one-kernel heads step against layers.attention_heads run eagerly: grouped queries, the cache rows
    at `slots` (v bit for bit), and no other cache row touched; q/k/v as row-strided views of one qkv."""
    from ddtree.fast.layers import attention_heads

    gen = torch.Generator().manual_seed(n * d)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype).cuda()
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_norm, k_norm = ((torch.rand(d, generator=gen) + 0.5).to(dtype).cuda() if norm else None for _ in range(2))
    angles = torch.randn(n, d // 2, generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype).cuda() for f in (torch.cos, torch.sin))
    slots = torch.randperm(100, generator=gen)[:n].cuda()
    want_cache = torch.randn(2, kv_heads, 100, d, generator=gen).to(dtype).cuda()
    got_cache = want_cache.clone()
    want = attention_heads(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, want_cache, slots)
    got = heads_kernel(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, got_cache, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the reference rounds after every op
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.allclose(got_cache.float(), want_cache.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got_cache[1], want_cache[1])


def distinct_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits without ties (each row a permutation of an even grid): tie order is left to each top-k."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]).float() * (12 / vocab) - 6


@pytest.mark.parametrize("budget", [1, 3, 16, 64, 128, 200])
@pytest.mark.parametrize("vocab", [50, 8192])
def test_the_one_kernel_tree_build_equals_the_pytorch_loop(budget, vocab):
    from ddtree.kernels.tree import top_prefixes

    logits = distinct_logits(15, vocab, seed=budget)
    want = top_prefixes(logits, budget)  # CPU: torch.topk and the per-depth PyTorch loop
    got = top_prefixes(logits.cuda(), budget)  # CUDA: the vocabulary kernels and the tree kernel
    for g, w in zip(got, want, strict=True):  # tokens, parents, depths, ancestor matrix
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "k"), [(20, 2), (8192, 64), (151936, 16), (151936, 128), (5000, 300)])
def test_vocab_top_kernels_equal_topk_and_logsumexp(dtype, vocab, k):
    from ddtree.kernels.tree import vocab_top

    logits = distinct_logits(15, vocab, seed=k).to(dtype)
    logp, tokens = vocab_top(logits.cuda(), k)
    wide = logits.float()
    top, want_tokens = wide.topk(k, dim=-1)
    want = top - wide.logsumexp(dim=-1, keepdim=True)
    if dtype == torch.bfloat16:  # rounding makes ties: among equal logits the lower token comes first
        want_tokens = wide.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(tokens.cpu(), want_tokens)
    assert torch.allclose(logp.cpu(), want, atol=1e-5, rtol=1e-6)


def test_sampled_rounds_replay_as_graphs_and_a_seed_fixes_the_output(fast_ckpt):
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", fast=True,
                                  fast_capacity=256)
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        gen = fast.stream([1, 2, 3, 4], params, method="ddtree", budget=16)
        list(gen)
        runs.append(gen.token_ids)
    plan = fast.fast.plan("ddtree", 16, sampled=True)
    assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
    assert runs[0] == runs[1] and len(runs[0]) == 40


@pytest.mark.parametrize("filters", [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.2, top_p=0.95),
                                     dict(top_k=20, top_p=0.9)])
def test_filtered_sampling_is_captured_in_graphs_and_stays_in_the_filtered_support(fast_ckpt, filters):
    """top-k / top-p / min-p run inside the sampled verify graph (not eagerly), and every token drawn is one
    the reference path's own filter keeps for that context (with a hair of slack on top-p and min-p: the two
    paths' float32 logits differ in the last bits)."""
    from ddtree.core.sampling import filter_logits

    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32",
                                  fast=True, fast_capacity=256)
    params = SamplingParams(max_new_tokens=24, temperature=1.3, seed=5, ignore_eos=True, **filters)
    prompt = [1, 2, 3, 4]
    gen = fast.stream(prompt, params, method="ddtree", budget=16)
    list(gen)
    plan = fast.fast.plan_for("ddtree", 16, params)
    assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
    ids = prompt + gen.token_ids
    with torch.no_grad():
        logits = fast.target.model(torch.tensor([ids], device="cuda")).logits[0, len(prompt) - 1:-1].float()
    loose = filter_logits(logits / params.temperature, params.top_k, min(1.0, params.top_p + 0.01), 0.95 * params.min_p)
    kept = loose > float("-inf")
    drawn = torch.tensor(gen.token_ids, device="cuda")
    assert kept[torch.arange(len(drawn)), drawn].all()


def test_penalized_rounds_with_logprobs_replay_as_graphs_and_give_the_reference_tokens(fast_ckpt):
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                            logit_bias=((5, 1.5),), logprobs=2)
    prompt = [40, 41, 42, 43, 40, 41, 42, 43]
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 16)):
        gen = fast.stream(prompt, params, method=method, budget=budget)
        got = [entry.logprob for r in gen for entry in r.logprobs]
        plan = fast.fast.plan_for(method, budget or 1, params)
        assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
        want = reference.generate(prompt, params, method=method, budget=budget)
        assert gen.token_ids == want.token_ids
        assert got == pytest.approx([entry.logprob for entry in want.logprobs], abs=1e-4)


def test_prompt_logprobs_and_a_warmed_up_engine_on_graphs_give_the_reference_entries(fast_ckpt):
    """Prompt logprobs prefill with every row's logits and decode in graphs; a warm-up before them (what a
    server runs before it is ready) leaves nothing that changes the next request."""
    from test_agreement import prompt_logprobs_agree

    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cuda", dtype="float32", fast=True,
                                  fast_capacity=256, method="ddtree", budget=16)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert fast.warm_up(SamplingParams()) == ["greedy"]
    params = SamplingParams(max_new_tokens=24, prompt_logprobs=3, logprobs=2, ignore_eos=True)
    prompt = list(range(40, 70))
    for method, budget in (("ar", None), ("ddtree", 16)):
        gen = fast.stream(prompt, params, method=method, budget=budget)
        rounds = list(gen)
        ref = reference.stream(prompt, params, method=method, budget=budget)
        ref_rounds = list(ref)
        plan = fast.fast.plan_for(method, budget or 1, params)
        assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
        assert gen.token_ids == ref.token_ids, method
        prompt_logprobs_agree(rounds[0].prompt_logprobs, ref_rounds[0].prompt_logprobs, tolerance=1e-4)
        got = [e.logprob for r in rounds for e in r.logprobs]
        assert got == pytest.approx([e.logprob for r in ref_rounds for e in r.logprobs], abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_rounds_replay_as_graphs_and_give_the_reference_tokens(tmp_path, dtype):
    """A Qwen3-MoE target: routing, the grouped expert GEMMs (or their fixed loop, where torch's grouped GEMM
    cannot run or be captured for this dtype) and the weighted sums captured in the round's graphs. float32
    must give the reference's tokens exactly; bf16 its tokens up to rounding."""
    from tiny import make_draft, make_target

    make_target(tmp_path / "moe", "qwen3_moe", seed=4)
    make_draft(tmp_path / "draft")
    fast = Engine.from_pretrained(tmp_path / "moe", tmp_path / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=256)
    experts = fast.fast.layers[0].experts
    assert experts.kernels_take(torch.zeros(65, experts.router.shape[1], device="cuda", dtype=experts.router.dtype))
    graph_rounds_match_ar(fast, [[1, 2, 3, 4, 5], list(range(60, 90))], dtype, (tmp_path / "moe", tmp_path / "draft"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_experts_equal_the_sparse_block_at_real_widths(dtype):
    """Qwen3-30B-A3B's widths (128 experts, 8 a token, 2048 -> 768): at an AR row (a run per pair), at trees
    of B = 16 and 64 and at a prompt chunk (a run per expert, some experts empty, some runs longer than one
    16-row tile). float32 against transformers' block; bf16 against the PyTorch steps on the same routing
    (transformers' router rounds its logits through another GEMM, which can flip a near-tie pick)."""
    from ddtree.kernels.moe import Experts
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg).to("cuda", dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    experts = Experts.of(block)
    for rows in (1, 17, 65, 256):
        h = torch.randn(rows, 2048, device="cuda").to(dtype)
        assert experts.kernels_take(h)
        with torch.no_grad():
            got = experts.routed_by_kernels(h)
            if dtype == torch.float32:
                want = block(h[None])[0]
                assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (rows, (got - want).abs().max())
            else:
                want = experts.routed_by_torch(h)
                assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=2e-2), (rows, (got - want).abs().max())


def graph_rounds_match_ar(fast: Engine, prompts: list[list[int]], dtype: str, checkpoints: tuple[Path, Path]) -> None:
    """Every method's rounds replay from graphs and give the reference's `ar` tokens. Rounding can flip a
    near-tie in bf16, so there the tokens may part from `ar`'s, but only where the reference itself is unsure:
    at the first token that differs, the reference's logit for its own token exceeds the fast path's token's
    by less than NEAR_TIE (these tiny random models' bf16 logits stray from float32's by up to ~0.5, a wrong
    forward's by whole units). In float32 the tokens are `ar`'s on the CPU (the `checkpoints`, target and
    draft): on CUDA, transformers' Gated DeltaNet layers run fla's Triton kernels, whose float32 products go
    through TF32, so the GPU's own eager forward is no float32 reference (on the Qwen3-Next target its logits
    stray 0.13 from the CPU's, and its `ar` parts from the CPU's where the top two are 0.0097 apart)."""
    if dtype == "float32":
        reference = Engine.from_pretrained(*checkpoints, device="cpu", dtype="float32")
    else:
        reference = Engine(fast.target, fast.draft, fast.tokenizer)
    for prompt in prompts:
        ar = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            list(gen)
            plan = fast.fast.plan(method, budget or 1)
            assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
            if gen.token_ids != ar:
                assert dtype != "float32", (method, budget)
                assert reference_margin(reference, prompt, ar, gen.token_ids) < NEAR_TIE, (method, budget)


NEAR_TIE = 0.25


def reference_margin(reference: Engine, prompt: list[int], want: list[int], got: list[int]) -> float:
    """At the first index where `got` parts from `want`, the reference's logit for want's token minus got's."""
    i = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
    ids = torch.tensor(prompt + want[:i], device=reference.target.device)
    logits = reference.target.forward(ids, torch.arange(len(ids), device=ids.device),
                                      reference.target.new_cache())[0][-1].float()
    return (logits[want[i]] - logits[got[i]]).item()


def test_constrained_rounds_replay_as_graphs_and_give_the_reference_tokens():
    pytest.importorskip("llguidance", reason="the server extra's llguidance (carry its wheel to the GPU machine)")
    from ddtree.core.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 9}},
              "required": ["ok", "name"], "additionalProperties": False}
    fast = Engine.from_pretrained(device="cuda", dtype="float32", fast=True)  # the demo pair: it has a tokenizer
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    ids = fast.chat_ids([{"role": "user", "content": "The status as JSON."}])
    for sampled in (False, True):
        params = SamplingParams(max_new_tokens=60, grammar=json_schema_grammar(schema), seed=1,
                                temperature=0.9 if sampled else 0.0)
        want = reference.generate(ids, params, method="ar").token_ids
        for method, budget in (("ar", None), ("ddtree", 16)):
            gen = fast.stream(ids, params, method=method, budget=budget)
            list(gen)
            plan = fast.fast.plan(method, budget or 1, sampled=sampled, constrained=True)
            assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
            assert set(json.loads(fast.decode(gen.token_ids))) == {"ok", "name"}
            if not sampled:
                assert gen.token_ids == want, method


def test_packed_grammar_masks_unpack_on_the_device_as_on_the_host():
    from ddtree.core.grammar import unpack

    bits = torch.randint(-2**31, 2**31 - 1, (65, 4748), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    assert torch.equal(unpack(bits.cuda(), 151936).cpu(), unpack(bits, 151936))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_hybrid_rounds_replay_as_graphs_and_give_the_reference_tokens(tmp_path, dtype, arch, monkeypatch):
    """A Qwen3.5 hybrid, and a Qwen3-Next one (experts and a shared expert in every layer): the closed-form
    Gated DeltaNet tree and its commit captured in the round's graphs (and Qwen3.5's AR steps through the
    one-row kernel, its trees of up to TREE_MAX nodes through the tree kernels): the reference's tokens up to
    its own near-ties (graph_rounds_match_ar)."""
    from ddtree.kernels import gdn
    from tiny import make_draft, make_hybrid_target

    trees, tree_step = [], gdn.tree_step
    monkeypatch.setattr(gdn, "tree_step", lambda *a: trees.append(a[1].shape[0]) or tree_step(*a))

    make_draft(tmp_path / "draft", taps=[1, 2])
    make_hybrid_target(tmp_path / "hybrid", arch, seed=0)
    fast = Engine.from_pretrained(tmp_path / "hybrid", tmp_path / "draft", device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=512)
    assert bool(fast.fast.gdn_rows) == (arch == "qwen3_5")  # Qwen3.5's AR steps: the one-row Gated DeltaNet kernel
    # the second prompt: two prompt chunks
    graph_rounds_match_ar(fast, [[1, 2, 3, 4, 5], list(range(10, 80)) * 5], dtype,
                          (tmp_path / "hybrid", tmp_path / "draft"))
    assert bool(trees) == (arch == "qwen3_5") and max(trees, default=0) <= gdn.TREE_MAX


@pytest.mark.parametrize("draft", ["draft_dflash2", "draft_sinks"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dflash2_and_2026_field_drafts_replay_as_graphs_and_give_the_targets_tokens(fast_ckpt, draft, dtype):
    """DFlash2's convolutions, transitions and selector tree, and a draft with sinks, a causal window, an embedding
    scale and a capped output, all inside the round's graphs: the reference path's rounds (float32) and the
    target's own tokens."""
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / draft, device="cuda", dtype=dtype, fast=True,
                                  fast_capacity=256)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert triton_works(fast.fast.device)
    for prompt in ([1, 2, 3, 4, 5], list(range(60, 90))):
        want = reference.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            rounds = list(gen)
            plan = fast.fast.plan(method, budget or 1)
            assert gen.on_fast_path and plan.graphs and plan.eager_reason is None
            if dtype == "float32":
                ref = reference.stream(prompt, GREEDY, method=method, budget=budget)
                ref_rounds = list(ref)
                assert gen.token_ids == ref.token_ids == want, (method, budget)
                assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds], (method, budget)


@pytest.mark.parametrize("budget", [16, 64, 256])
def test_the_selector_tree_program_equals_the_pytorch_loop_on_the_gpu(budget):
    """At the published drafters' size (15 depths, 16 candidates), compiled."""
    from ddtree.kernels import selector

    gen = torch.Generator().manual_seed(budget)
    logp = torch.log_softmax(torch.randn(15, 16, 16, generator=gen) * 3, dim=-1)
    ordered, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    tokens = torch.stack([torch.randperm(151936, generator=gen)[:16] for _ in range(15)])
    want = selector.selector_prefixes(ordered, order, tokens, budget)  # CPU: the PyTorch loop
    on = [t.cuda() for t in (ordered, order, tokens)]
    got = selector._build_on_gpu(*on, selector._frontier(budget, 16, on[0].device), budget, want[0].numel())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    assert torch.equal(selector._chain_on_gpu(on[1], on[2]).cpu(), selector.selector_chain(ordered, order, tokens)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "groups"), [(16, 4), (1, 4), (65, 2)])
def test_tree_attention_with_sinks_matches_the_reference_on_the_gpu(dtype, n, groups):
    from ddtree.kernels.attention import tree_attention, tree_mask

    capacity, start, d = 512, 150, 64
    q, cache, visible, _ = attention_case(n, groups, d, capacity, start, None)
    sinks = torch.randn(2 * groups, generator=torch.Generator().manual_seed(n)) * 3
    want = tree_attention(q, cache, dataclasses.replace(
        tree_mask(torch.tensor(start), visible, capacity, groups, d, torch.float32), sinks=sinks))
    mask = tree_mask(torch.tensor(start).cuda(), visible.cuda(), capacity, groups, d, dtype)
    got = tree_attention(q.cuda().to(dtype), cache.cuda().to(dtype), dataclasses.replace(mask, sinks=sinks.cuda()))
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float().cpu(), want, atol=tolerance, rtol=tolerance)
