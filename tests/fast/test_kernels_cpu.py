"""The fast path's Triton kernels, run by Triton's interpreter on the CPU (float32, small shapes).

On a machine without CUDA, tests/conftest.py turns on TRITON_INTERPRET before any kernel is defined, so
CI checks every kernel's logic (tiling, masks, split-K sums, the tree program) against its PyTorch
reference, and whole generations on the kernels against the reference path; `tests/fast/test_cuda.py`
runs the same kernels compiled, at real sizes, and in CUDA graphs, on a GPU.
"""

import os

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.kernels import jit
from test_agreement import prompt_logprobs_agree
from test_cuda import (
    argmax_case,
    attention_case,
    compaction_case,
    distinct_logits,
    gdn_case,
    gemv_case,
    paired_projection_case,
    quantized_rows_case,
    rows_case,
    walk_case,
)
from tiny import make_draft, make_hybrid_target, make_target

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreted kernels run on CPU-only machines (the GPU compiles them)")


@pytest.mark.parametrize(("rows", "n", "k", "split_k"), [(2, 40, 64, 1), (17, 96, 256, 1), (5, 100, 512, 4),
                                                         (33, 70, 128, 2)])
def test_skinny_gemm_equals_a_float64_product_and_resets_its_counters(rows, n, k, split_k):
    from ddtree.kernels import gemm

    gen = torch.Generator().manual_seed(rows * n)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    config = dict(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    y = gemm.skinny_linear(x, weight, config)
    assert torch.allclose(y.double(), x.double() @ weight.double().T, atol=1e-4, rtol=1e-4)
    assert torch.equal(gemm.skinny_linear(x, weight, config), y)  # the last arrival sums in a fixed order
    assert not gemm._counters(x.device, 1).any()  # ... and leaves every counter at zero


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


def test_few_row_gemm_on_a_gpu_with_little_shared_memory_fits_its_tiles_and_stays_right(monkeypatch):
    from ddtree.kernels import gemm

    monkeypatch.setattr(jit, "_FITTED", {})
    small = SmallGPU(gemm._skinny_kernel, {"num_stages": 1, "BLOCK_K": 64})
    monkeypatch.setattr(gemm, "_skinny_kernel", small)
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(5, 512, generator=gen), torch.randn(40, 512, generator=gen)
    config = dict(block_n=32, block_k=128, split_k=2, num_warps=4, num_stages=2)
    y = gemm.skinny_linear(x, weight, config)
    assert torch.allclose(y.double(), x.double() @ weight.double().T, atol=1e-4, rtol=1e-4)
    assert small.tried == [{"num_stages": 2, "BLOCK_K": 128}, {"num_stages": 1, "BLOCK_K": 128},
                           {"num_stages": 1, "BLOCK_K": 64}]


def test_tree_attention_on_a_gpu_with_little_shared_memory_fits_its_tiles_and_stays_right(monkeypatch):
    from ddtree.kernels import attention

    monkeypatch.setattr(jit, "_FITTED", {})
    small = SmallGPU(attention._split_kernel, {"num_stages": 1, "BLOCK_N": 16})
    monkeypatch.setattr(attention, "_split_kernel", small)
    n, groups, d, capacity, start = 7, 2, 16, 64, 20
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, None)
    mask = attention.TreeMask(torch.tensor(start), n, None, visible=visible.view(torch.int8))
    config = dict(block_m=16, block_n=64, splits=2, num_warps=4, num_stages=2, two_loops=1)
    got = attention._triton_attention(q, cache, mask, config)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert small.tried[-1] == {"num_stages": 1, "BLOCK_N": 16} and len(small.tried) == 4  # 2 stages, 64, 32, 16


def test_moe_experts_on_a_gpu_with_little_shared_memory_fit_their_tiles_and_stay_right(tmp_path, monkeypatch):
    """In float32 the gate/up kernel's tuned tiles need 144 KB of shared memory, more than a consumer GPU has
    (benchmarks/kernel_resources.py): both expert kernels shrink their tiles rather than fail."""
    from ddtree.kernels import moe
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(jit, "_FITTED", {})
    monkeypatch.setattr(jit, "INTERPRETED_ON_CPU", True)
    small_up = SmallGPU(moe._up_kernel, {"num_stages": 1, "BLOCK_N": 32})
    small_down = SmallGPU(moe._down_kernel, {"num_stages": 2, "BLOCK_N": 64})
    monkeypatch.setattr(moe, "_up_kernel", small_up)
    monkeypatch.setattr(moe, "_down_kernel", small_down)
    make_target(tmp_path / "moe", "qwen3_moe", seed=4)
    mlp = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).model.layers[0].mlp
    experts = moe.Experts.of(mlp)
    h = torch.randn(3, mlp.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    assert experts.kernels_take(h)
    with torch.no_grad():
        want = mlp(h[None])[0]
        got = experts.routed_by_kernels(h)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), (got - want).abs().max()
    assert small_up.tried == [{"num_stages": 3, "BLOCK_N": 64}, {"num_stages": 2, "BLOCK_N": 64},
                              {"num_stages": 1, "BLOCK_N": 64}, {"num_stages": 1, "BLOCK_N": 32}]
    assert small_down.tried == [{"num_stages": 3, "BLOCK_N": 64}, {"num_stages": 2, "BLOCK_N": 64}]
    small_up.tried.clear()  # the next call (a graph capture after its warm-up) launches the fit at once
    experts.routed_by_kernels(h)
    assert small_up.tried == [{"num_stages": 1, "BLOCK_N": 32}]


@pytest.mark.parametrize("mode", ["plain", "norm", "norm_first", "silu"])
def test_one_row_gemv_equals_its_unfused_steps(mode):
    y, want = gemv_case(40, 64, mode, torch.float32, "cpu")
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-5), (y - want).abs().max()


@pytest.mark.parametrize(("n", "groups", "window"), [(1, 4, None), (7, 2, None), (7, 2, 5), (19, 1, None)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("two_loops", [0, 1, 2])
def test_tree_attention_kernel_matches_sdpa(n, groups, window, splits, two_loops):
    """Every loop form. With 3 splits of 16 keys one split holds both committed keys (up to 20) and new ones;
    in the third form the new rows' keys (up to 19, two blocks) take the last split alone, the 20 committed
    keys the other two (one split: every key in it, as the second form)."""
    from ddtree.kernels.attention import TreeMask, _triton_attention

    d, capacity, start = 16, 64, 20
    q, cache, visible, want = attention_case(n, groups, d, capacity, start, window)
    mask = TreeMask(torch.tensor(start), n, window, visible=visible.view(torch.int8))
    config = dict(block_m=16, block_n=16, splits=splits, num_warps=4, num_stages=1, two_loops=two_loops)
    got = _triton_attention(q, cache, mask, config)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_tree_attention_takes_a_mask_that_is_a_view(kernels_on_cpu):
    """A hybrid's later prompt chunk passes its rows of the whole prompt's causal mask, a view whose rows are
    strided: the kernel must see the chunk's own causal mask, as SDPA does."""
    from ddtree.kernels.attention import tree_attention, tree_mask

    gen = torch.Generator().manual_seed(0)
    prompt, lo, heads, groups, d, capacity = 12, 7, 2, 2, 16, 32
    causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()
    chunk = causal[lo:, lo:]
    assert not chunk.is_contiguous()
    n = prompt - lo
    q, cache = torch.randn(heads, groups * n, d, generator=gen), torch.randn(2, heads, capacity, d, generator=gen)
    mask = tree_mask(torch.tensor(lo), chunk, capacity, groups, d, torch.float32)
    assert mask.visible is not None  # the Triton kernel's form (SDPA's additive mask handles views by itself)
    got = tree_attention(q, cache, mask)
    columns = torch.arange(capacity)
    allowed = (columns[None, :] <= lo + torch.arange(n)[:, None]).repeat(groups, 1)  # the chunk's causal rule
    want = torch.nn.functional.scaled_dot_product_attention(q[None], cache[0][None], cache[1][None],
                                                            attn_mask=allowed[None, None])[0]
    want = want.view(heads, groups, n, d).permute(2, 0, 1, 3).reshape(n, -1)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize(("heads", "k_heads", "d"), [(4, 2, 16), (2, 2, 16), (2, 1, 64)])
@pytest.mark.parametrize("nodes", [1, 2, 9, 24])
def test_gated_deltanet_kernels_equal_the_pytorch_steps(heads, k_heads, d, nodes, monkeypatch):
    from ddtree.kernels import gdn

    monkeypatch.setattr(gdn, "TREE_SLICE", 32)  # at d 64: two d_v slices
    monkeypatch.setattr(gdn, "TREE_CONFIGS", dict.fromkeys(gdn.TREE_CONFIGS, (4, 16)))  # 24 nodes: two row tiles
    got, want = gdn_case(heads, k_heads, d, torch.float32, "cpu", nodes)
    assert torch.equal(got[1], want[1])  # the conv window's columns, copied
    for name, g, w in zip(("out", "keys", "u", "decay"), got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), (name, (g - w).abs().max())


@pytest.mark.parametrize("block_t", [1, 2, 4])  # 1: a GPU's programs; 2: a partial last block; 4: the CPU's
@pytest.mark.parametrize("norm", [True, False])
def test_attention_heads_kernel_equals_the_reference_step(norm, block_t, monkeypatch):
    from ddtree.fast.layers import attention_heads
    from ddtree.kernels import heads as heads_module
    from ddtree.kernels.heads import attention_heads as heads_kernel

    monkeypatch.setattr(heads_module, "launch_rows", lambda n, device: block_t)

    n, heads, kv_heads, d = 3, 4, 2, 16
    gen = torch.Generator().manual_seed(n * d)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_norm, k_norm = (torch.rand(d, generator=gen) + 0.5 if norm else None for _ in range(2))
    angles = torch.randn(n, d // 2, generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    slots = torch.tensor([7, 2, 11])
    want_cache = torch.randn(2, kv_heads, 16, d, generator=gen)
    got_cache = want_cache.clone()
    want = attention_heads(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, want_cache, slots)
    got = heads_kernel(q, k, v, q_norm, k_norm, 1e-6, cos, sin, kv_heads, d, got_cache, slots)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got_cache, want_cache, atol=1e-5, rtol=1e-5) and torch.equal(got_cache[1], want_cache[1])


@pytest.mark.parametrize("width", [64, 80])  # 80: a width that is not a power of two (masked columns)
def test_row_kernels_equal_the_reference_norms_and_silu(width):
    """The row kernels against the reference's functions in float32. Triton's interpreter truncates float32 to
    bfloat16 where a GPU rounds to nearest, so test_cuda.py checks the kernels' bfloat16 rounding."""
    rows_case(5, width, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "chunk"), [(300, 64), (200, 128)])
def test_the_argmax_kernels_equal_torchs_argmax(dtype, vocab, chunk):
    argmax_case(5, vocab, dtype, "cpu", chunk)


@pytest.mark.parametrize(("path", "start"), [([0, 2, 5, 9], 7), ([0, 1, 2], 0), ([0, 3, 4, 0, 0], 1)])
def test_the_compaction_kernel_moves_the_path_rows_in_place(kernels_on_cpu, path, start):
    compaction_case(path, start, torch.float32, "cpu")


@pytest.mark.parametrize(("budget", "accept_depth"), [(1, 1), (5, 0), (16, 15), (40, 3), (70, 4)])
def test_the_walk_kernel_accepts_the_path_the_picks_spell(budget, accept_depth):
    walk_case(budget, accept_depth, seed=budget + accept_depth, device="cpu")


@pytest.mark.parametrize(("vocab", "k", "dtype"), [(20, 2, torch.float32), (300, 16, torch.float32),
                                                   (2500, 40, torch.float32), (20, 2, torch.bfloat16),
                                                   (2500, 40, torch.bfloat16)])
def test_vocab_top_kernels_equal_topk_and_logsumexp(vocab, k, dtype):
    """bf16 logits take the kernel's int32 keys; among tied logits the lower token comes first. 2500 logits
    make three chunks at k = 40 (interpreted, each chunk's bitonic top-k takes seconds)."""
    from ddtree.kernels.tree import _vocab_top_on_gpu

    logits = distinct_logits(4, vocab, seed=k)
    if dtype == torch.bfloat16:
        # 7 values: every top-k crosses ties, within chunks and between them (+ 0.0: no -0.0, which the keys
        # order below +0.0 where a stable sort sees a tie)
        logits = logits.div(2).round() + 0.0
    logits = logits.to(dtype)
    logp, tokens = _vocab_top_on_gpu(logits, k)
    wide = logits.float()
    top, want_tokens = wide.topk(k, dim=-1)
    if dtype == torch.bfloat16:
        want_tokens = wide.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(tokens, want_tokens)
    assert torch.allclose(logp, top - wide.logsumexp(dim=-1, keepdim=True), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize(("vocab", "k"), [(20, 2), (300, 16)])
def test_vocab_top_kernels_map_a_draft_vocabularys_columns_to_token_ids(vocab, k):
    """A draft vocabulary's column c is token token_ids[c]: the merge kernel writes the ids, as the CPU path does."""
    from ddtree.kernels.tree import _vocab_top_on_gpu, vocab_top

    logits = distinct_logits(3, vocab, seed=vocab)
    token_ids = torch.randperm(5 * vocab, generator=torch.Generator().manual_seed(k))[:vocab]
    logp, tokens = _vocab_top_on_gpu(logits, k, token_ids)
    want_logp, want_tokens = vocab_top(logits, k, token_ids)  # the CPU path: torch.topk, then the ids
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(tokens, token_ids[_vocab_top_on_gpu(logits, k)[1]])
    assert torch.allclose(logp, want_logp, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize(("rows", "width", "dtype"), [(16, 64, torch.bfloat16), (5, 7, torch.float32),
                                                      (1, 3000, torch.float32), (0, 64, torch.float32)])
def test_the_gather_kernel_equals_index_select(kernels_on_cpu, rows, width, dtype):
    """Embeddings, rotary rows and tap features go through it: any index, repeated or not, any row width (one
    slice per program on a GPU), and no rows at all."""
    from ddtree.kernels.gather import gather_rows

    gen = torch.Generator().manual_seed(rows + width)
    table = torch.randn(40, width, generator=gen).to(dtype)
    index = torch.randint(0, 40, (rows,), generator=gen)
    assert torch.equal(gather_rows(table, index), table.index_select(0, index))


def test_the_read_bandwidth_kernel_reads_every_element_once():
    """`ddtree bench` times its read floor with this kernel: its sums prove it read all the bytes it counts."""
    from ddtree.bench.timing import READ_BLOCK, read_sums

    data = torch.randn(3 * READ_BLOCK, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sums = read_sums(data, torch.empty(3))
    assert torch.allclose(sums, data.float().view(3, READ_BLOCK).sum(dim=1), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize(("budget", "vocab"), [(1, 50), (5, 50), (16, 50), (24, 300)])
def test_the_one_program_tree_build_equals_the_pytorch_loop(budget, vocab):
    from ddtree.kernels.tree import _build_on_gpu, _frontier, top_prefixes, tree_size, vocab_top

    logits = distinct_logits(5, vocab, seed=budget)
    want = top_prefixes(logits, budget)  # on the CPU: the per-depth PyTorch loop
    k = min(budget, vocab)
    logp, tokens = vocab_top(logits, k)
    got = _build_on_gpu(logp, tokens, _frontier(budget, k, logits.device), budget, tree_size(5, vocab, budget))
    for g, w in zip(got, want, strict=True):  # tokens, parents, depths, ancestor matrix
        assert torch.equal(g, w)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The fast path runs its Triton kernels (interpreted) on the CPU, where it would otherwise take PyTorch."""
    from ddtree.kernels import jit

    monkeypatch.setattr(jit, "INTERPRETED_ON_CPU", True)


def test_a_walk_kernel_that_cannot_launch_leaves_the_walk_to_pytorch(kernels_on_cpu, monkeypatch, capsys):
    """A GPU where the walk's kernel cannot build or launch (an old Triton, too little shared memory at a large
    budget) still gets every round's right answer: `accept` takes the PyTorch steps for that shape, says so once,
    and does not try the kernel again."""
    from ddtree.kernels import jit, walk
    from ddtree.kernels.tree import top_prefixes

    monkeypatch.setattr(jit, "_DECLINED", set())
    tries = []

    def cannot_launch(*args):
        tries.append(args)
        raise jit.OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(walk, "_accept_kernel", cannot_launch)
    tokens, parents, depths, visible = top_prefixes(torch.randn(15, 30, generator=torch.Generator().manual_seed(3)), 20)
    ids = torch.cat([torch.tensor([4]), tokens])
    picks = torch.roll(ids, -1)  # the root's pick is node 1's token: node 1 is accepted
    want = walk.accept_torch(ids, picks, parents, depths, visible, 15)
    for _ in range(2):
        got = walk.accept(ids, picks, parents, depths, visible, 15)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and int(got[2]) >= 2
    assert len(tries) == 1
    assert capsys.readouterr().err.count("the acceptance walk kernel cannot run at (21, 15) on this GPU") == 1


def test_linear_takes_the_gemv_for_one_row_of_a_narrow_weight(kernels_on_cpu, monkeypatch):
    """One row of a weight up to ROW_GEMV_MAX_N wide goes through the GEMV (wider ones keep F.linear); either way
    the product is F.linear's."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm
    from ddtree.kernels.gemv import gemv

    calls = []
    monkeypatch.setattr(gemm, "gemv", lambda x, weight: calls.append(weight.shape[0]) or gemv(x, weight))
    monkeypatch.setattr(gemm, "ROW_GEMV_MAX_N", 48)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=gen)
    for n, routed in ((40, True), (56, False)):
        weight = torch.randn(n, 64, generator=gen)
        assert torch.allclose(gemm.linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
        assert (calls[-1:] == [n]) == routed
    assert calls == [40]


# each target's methods; together they put every kernel in place, each dense-attention target every
# attention form: one loop (AR rows), two loops in short tiles (up to 128 grouped rows) and in tall ones (65 nodes)
GENERATIONS = {"qwen3": [("ar", None), ("ddtree", 24), ("ddtree", 64)],
               "hybrid": [("ar", None), ("ddtree", 24), ("ddtree", 64)], "hybrid_moe": [("ar", None)],
               "moe": [("ar", None), ("ddtree", 24)]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GENERATIONS))
def test_generations_on_the_interpreted_kernels_equal_the_reference_path(name, kernels_on_cpu, tmp_path, monkeypatch):
    """Every kernel in place (GEMVs for AR steps, the few-row GEMM, the heads step, tree attention, the
    vocabulary top-k, the tree program, the MoE experts, a Gated DeltaNet layer's AR step and tree): the
    reference's tokens, acceptance, logprobs and prompt logprobs, for a dense target, a dense and an MoE hybrid,
    and a mixture-of-experts one. One test per target, so that each stays well inside the per-test timeout on
    a slow machine (interpreted, the four took 119, 162, 48 and 21 s on one 2-core machine). The methods are the
    fewest that run every kernel form: dflash and ddtree 5 ran no kernel that ddtree 24 does not."""
    from ddtree.fast import hybrid as fast_hybrid
    from ddtree.kernels import attention, gdn, gemm
    from ddtree.kernels.heads import attention_heads as heads_kernel

    monkeypatch.setattr(fast_hybrid, "PROMPT_CHUNK", 7)  # a hybrid's 10-token prompt: chunks of 7 and 3 nodes
    if name in ("qwen3", "moe"):  # 2 target layers and 1 draft layer (interpreted, every launch is slow)
        draft = make_draft(tmp_path / "draft", target_layers=2, layers=1, taps=[0, 1])
        target = make_target(tmp_path / name, "qwen3" if name == "qwen3" else "qwen3_moe", seed=4, layers=2)
    else:
        draft = make_draft(tmp_path / "draft", taps=[1, 2])
        target = make_hybrid_target(tmp_path / name, "qwen3_5" if name == "hybrid" else "qwen3_5_moe",
                                    seed=0 if name == "hybrid" else 1)
    params = SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    launches, gdn_steps, attention_forms = [], set(), set()
    real, real_row, real_tree = gemm.skinny_linear, gdn.row_step, gdn.tree_step
    real_config = attention.launch_config

    def launch_config(*args: int) -> dict[str, int]:
        cfg = real_config(*args)
        attention_forms.add((cfg["block_m"], cfg["two_loops"]))
        return cfg

    monkeypatch.setattr(attention, "launch_config", launch_config)
    monkeypatch.setattr(gdn, "row_step", lambda *a: gdn_steps.add("row") or real_row(*a))
    monkeypatch.setattr(gdn, "tree_step", lambda *a: gdn_steps.add("tree") or real_tree(*a))
    counting = lambda *a, **kw: launches.append(1) or real(*a, **kw)  # noqa: E731
    fast = Engine.from_pretrained(target, draft, device="cpu", fast=True, fast_capacity=128)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    if name == "qwen3":  # (a hybrid's forward has neither)
        assert fast.fast.row_gemv and fast.fast.ops.attention_heads is heads_kernel
    if name == "moe":  # its experts through the Triton kernels, its AR steps through the GEMV layers
        assert fast.fast.row_gemv
        experts = fast.fast.layers[0].experts
        assert experts.kernels_take(torch.zeros(25, experts.router.shape[1]))
    for method, budget in GENERATIONS[name]:
        monkeypatch.setattr(gemm, "skinny_linear", counting)  # counted on the fast path only
        gen = fast.stream(list(range(30, 40)), params, method=method, budget=budget)
        rounds = list(gen)
        monkeypatch.setattr(gemm, "skinny_linear", real)
        ref = reference.stream(list(range(30, 40)), params, method=method, budget=budget)
        ref_rounds = list(ref)
        assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids, (method, budget)
        assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds]
        got = [lp.logprob for r in rounds for lp in r.logprobs]
        assert got == pytest.approx([lp.logprob for r in ref_rounds for lp in r.logprobs], abs=1e-4)
        prompt_logprobs_agree(rounds[0].prompt_logprobs, ref_rounds[0].prompt_logprobs, tolerance=1e-4)
    if name in ("qwen3", "moe"):
        assert launches  # the few-row GEMM ran (draft blocks, small trees)
    if name in ("qwen3", "hybrid"):
        assert {(16, 0), (16, 2), (64, 2)} <= attention_forms  # an AR row, a draft block, a 65-node tree
    if name.startswith("hybrid"):  # AR steps through the row kernel, trees and prompts through the tree kernel
        assert gdn_steps == {"row", "tree"}


def e4m3_grid_rows(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose values, divided by their scale, already lie on the e4m3 grid (each row's largest magnitude
    448, the scales powers of two): (rows x, their e4m3 values, their scales)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, k), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN codes
    values = codes.view(torch.float8_e4m3fn).float()
    values[:, 1] = 448.0 * torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0)
    scales = 2.0 ** torch.randint(-12, 4, (rows,), generator=gen).float()
    return values * scales[:, None], values, scales


@pytest.mark.parametrize(("rows", "k"), [(3, 64), (5, 200)])
def test_the_row_quantization_kernel_finds_each_rows_scale_and_its_e4m3_values(rows, k):
    """Interpreted, on values that need no rounding: Triton's interpreter casts to e4m3 without carrying a
    rounded-up mantissa into the exponent (125.2 becomes 64, not 128), so the rounding itself is checked on the
    GPU (tests/fast/test_cuda.py: bit for bit with torch's cast)."""
    from ddtree.kernels.rows import quantize

    x, values, scales = e4m3_grid_rows(rows, k, seed=rows)
    q, scale = quantize(x)
    assert torch.equal(scale, scales)  # 448 x 2^e / 448
    assert torch.equal(q.float(), values)


@pytest.mark.parametrize(("n", "width"), [(3, 64), (5, 192)])
def test_quantizing_row_kernels_equal_the_row_kernels_then_the_quantization_kernel(n, width):
    """Interpreted, against the interpreted kernels they fold together (which share the interpreter's e4m3 cast:
    see above); test_cuda.py holds them to torch's cast too."""
    quantized_rows_case(n, width, torch.float32, "cpu")


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 64), (16, 96, 256), (5, 100, 512), (70, 48, 128)])
def test_the_fp8_gemm_equals_the_reference_on_the_same_quantized_rows(rows, n, k, monkeypatch):
    """One row tile with and without K splits (512: two 256-wide slices summed by the last program), and 70 rows
    in three tiles of 32."""
    from ddtree.kernels import fp8 as quantize
    from ddtree.kernels import gemm

    monkeypatch.setattr(gemm, "FP8_ROW_TILE", 32)
    gen = torch.Generator().manual_seed(rows + n)
    weight = quantize.quantize_weight(torch.randn(n, k, generator=gen))
    xq, xs = quantize.quantize_rows(torch.randn(rows, k, generator=gen))
    want = (xq.double() @ weight.data.double().T) * (xs.double()[:, None] * weight.scale.double()[None, :])
    got = gemm.skinny_fp8(xq, xs, weight, torch.float32)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gemm.skinny_fp8(xq, xs, weight, torch.float32), got)  # K splits summed in a fixed order
    assert not gemm._counters(xq.device, 1).any()


@pytest.mark.parametrize(("rows", "n2", "fp8"), [(5, 40, False), (16, 128, False), (5, 40, True)])
def test_paired_projections_equal_their_own_products(kernels_on_cpu, rows, n2, fp8):
    """The second weight's rows fill the columns after the first's 64: a ragged last tile, K split or not."""
    paired_projection_case(rows, 64, n2, 256, fp8, "cpu")


@pytest.mark.slow
def test_an_fp8_draft_on_the_interpreted_kernels_gives_the_targets_tokens(kernels_on_cpu, tmp_path, monkeypatch):
    """A quantized drafter with every fp8 kernel in place (the row quantization, alone and folded into the norms
    and SiLU · up, and the GEMM, for the block pass, the commit's context projections and the head): the output
    is the reference path's `ar` output."""
    from ddtree.kernels import gemm, rows

    launches, folded = [], []
    real = gemm.skinny_fp8
    monkeypatch.setattr(gemm, "skinny_fp8", lambda *a: launches.append(a[2].shape) or real(*a))
    for name in ("rms_norm_fp8", "silu_mul_fp8"):
        kernel = getattr(rows, name)
        monkeypatch.setattr(rows, name, lambda *a, kernel=kernel, name=name: folded.append(name) or kernel(*a))
    draft = make_draft(tmp_path / "draft", target_layers=2, layers=1, taps=[0, 1])
    target = make_target(tmp_path / "qwen3", "qwen3", seed=4, layers=2)
    fast = Engine.from_pretrained(target, draft, device="cpu", fast=True, fast_capacity=128,
                                  draft_quantization="fp8")
    reference = Engine.from_pretrained(target, draft, device="cpu")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = reference.generate(list(range(30, 40)), params, method="ar").token_ids
    gen = fast.stream(list(range(30, 40)), params, method="ddtree", budget=16)
    rounds = list(gen)
    assert gen.backend.name == "fast" and gen.token_ids == want and len(rounds) > 1
    heads = fast.draft_head.size
    assert {(heads, 64), (2 * 16 * 2, 64), (64, 128)} <= set(launches)  # the head, the context k/v, fc
    assert set(folded) == {"rms_norm_fp8", "silu_mul_fp8"}


@pytest.mark.parametrize(("depth", "k", "budget"), [(4, 3, 1), (5, 4, 9), (6, 4, 30), (4, 2, 40)])
def test_the_selector_tree_program_equals_the_pytorch_loop(depth, k, budget):
    """DFlash2's tree over its transition model: the one-program build against selector_prefixes' PyTorch loop,
    and the chain program against the chain's loop."""
    from ddtree.kernels import selector

    gen = torch.Generator().manual_seed(budget + k)
    logp = torch.log_softmax(torch.randn(depth, k, k, generator=gen) * 2, dim=-1)
    ordered, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    tokens = torch.stack([torch.randperm(90, generator=gen)[:k] for _ in range(depth)])
    want = selector.selector_prefixes(ordered, order, tokens, budget)  # on the CPU: the per-depth PyTorch loop
    kk = min(budget, k)
    got = selector._build_on_gpu(ordered, order, tokens, selector._frontier(budget, kk, logp.device), budget,
                                 want[0].numel())
    for g, w in zip(got, want, strict=True):  # tokens, parents, depths, ancestor matrix
        assert torch.equal(g, w)
    assert torch.equal(selector._chain_on_gpu(order, tokens), selector.selector_chain(ordered, order, tokens)[0])


@pytest.mark.parametrize(("n", "groups", "splits", "two_loops"), [(8, 2, 1, 0), (8, 2, 3, 1), (8, 1, 3, 2),
                                                                  (1, 4, 2, 0)])
def test_tree_attention_kernel_with_sinks_matches_the_reference(n, groups, splits, two_loops):
    """A drafter's per-head sink logits join each softmax: in the split kernel's own output (one split) or in the
    merge (several), as in the CPU reference's extra column."""
    import dataclasses

    from ddtree.kernels.attention import TreeMask, _triton_attention, tree_attention, tree_mask

    d, capacity, start = 16, 64, 20
    gen = torch.Generator().manual_seed(n + splits)
    q, cache = torch.randn(2, groups * n, d, generator=gen), torch.randn(2, 2, capacity, d, generator=gen)
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    sinks = torch.randn(2 * groups, generator=gen) * 3
    plain = tree_mask(torch.tensor(start), visible, capacity, groups, d, torch.float32)
    want = tree_attention(q, cache, dataclasses.replace(plain, sinks=sinks))
    assert not torch.allclose(want, tree_attention(q, cache, plain), atol=1e-3)  # the sinks matter here
    mask = TreeMask(torch.tensor(start), n, None, visible=visible.view(torch.int8), sinks=sinks)
    config = dict(block_m=16, block_n=16, splits=splits, num_warps=4, num_stages=1, two_loops=two_loops)
    got = _triton_attention(q, cache, mask, config)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.slow
def test_a_dflash2_draft_with_sinks_on_the_interpreted_kernels_gives_the_reference_rounds(kernels_on_cpu, tmp_path):
    """Every drafter feature on the device kernels at once (a causal windowed layer with sinks, the convolutions,
    the selector's transitions, the selector tree and chain programs, sink attention): the reference path's
    tokens and acceptance, round for round."""
    from tiny import make_dflash2_draft

    draft = make_dflash2_draft(tmp_path / "draft", target_layers=2, layers=1, taps=[0, 1], is_causal=None,
                               sliding_window=4, sinks="sinks")
    target = make_target(tmp_path / "qwen3", "qwen3", seed=4, layers=2)
    fast = Engine.from_pretrained(target, draft, device="cpu", fast=True, fast_capacity=128)
    reference = Engine(fast.target, fast.draft, fast.tokenizer)
    assert fast.draft.config.layer_causal == (True,) and fast.fast.fused_draft.sinks[0] is not None
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for method, budget in (("dflash", None), ("ddtree", 24)):
        gen = fast.stream(list(range(30, 40)), params, method=method, budget=budget)
        rounds = list(gen)
        ref = reference.stream(list(range(30, 40)), params, method=method, budget=budget)
        ref_rounds = list(ref)
        assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids, method
        assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds], method
    assert not [key for key in jit._DECLINED if key[0].startswith("selector")]  # its programs ran, interpreted
