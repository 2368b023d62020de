"""The batched (varlen) Gated DeltaNet tree kernels against the single-sequence ones and the PyTorch steps."""

import pytest
import torch
from cases import gdn_module
from marks import gpu, interpreted
from trees import ancestry

# (parents per node: -1 for the root, parents first; pool slot) per sequence: a small tree, an AR step, a padding
# sequence without rows, a causal chain; slots out of order
SEQUENCES = [([-1, 0, 0, 1, 1, 2, 5], 4), ([-1], 0), ([], 5), ([-1, *range(19)], 2)]
SLOTS, PADDING = 6, 3  # pool size; rows after the last sequence's


def varlen_case(heads: int, k_heads: int, d: int, dtype: torch.dtype, device: str, max_rows: int) -> None:
    """A random Qwen3.5 Gated DeltaNet layer over a batch of SEQUENCES in one varlen_tree_step (padded to
    max_rows): each sequence's output and record equal tree_step's on its rows and pool slot, and the PyTorch
    steps' to a tolerance; the pools are left as they were, and nothing is written to rows of no sequence.

    Equal to tree_step exactly in the interpreter: the same jit helpers on the same data, and its float32
    sums and products of a wider padded tree only add exact zeros. Compiled, a sequence padded wider than
    tree_step pads it (to max_rows, not its own n) takes its reductions and tensor-core products in other
    layouts, so float32 round-off may differ: checked to the tolerance there."""
    from ddtree.fast.delta import conv_sources, tree_delta_rule
    from ddtree.fast.hybrid import conv_and_gates
    from ddtree.kernels import gdn
    from ddtree.models.hybrid import split_heads

    module = gdn_module(heads, k_heads, d, dtype, device, heads + d)
    conv_dim, taps = module.conv_dim, module.conv_kernel_size
    sizes = [len(parents) for parents, _ in SEQUENCES]
    rows, batch = sum(sizes) + PADDING, len(SEQUENCES)
    trees = [ancestry(parents) for parents, _ in SEQUENCES]
    row_offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)
    vis_offsets = torch.tensor([0, *torch.tensor([n * n for n in sizes]).cumsum(0).tolist()[:-1]], dtype=torch.int32,
                               device=device)
    seq_slots = torch.tensor([slot for _, slot in SEQUENCES], dtype=torch.int32, device=device)
    visible = torch.cat([vis.flatten() for vis, _ in trees]).to(device)
    sources = torch.cat([conv_sources(vis, depths, taps) for vis, depths in trees if depths.numel()]
                        + [torch.zeros(PADDING, taps, dtype=torch.long)]).to(device)
    proj = torch.randn(rows, conv_dim + module.value_dim + 2 * heads, device=device).to(dtype)
    conv_pool = torch.randn(SLOTS, taps - 1, conv_dim, device=device).to(dtype)
    state_pool = torch.randn(SLOTS, heads, d, d, device=device) / d
    pools = conv_pool.clone(), state_pool.clone()
    nan = float("nan")
    record = (torch.full((batch * (taps - 1) + rows, conv_dim), nan, device=device, dtype=dtype),
              torch.full((rows, heads, d), nan, device=device), torch.full((rows, heads, d), nan, device=device),
              torch.full((rows, heads), nan, device=device))
    out = gdn.varlen_tree_step(module, proj, conv_pool, state_pool, seq_slots, row_offsets, sources, visible,
                               vis_offsets, *record, max_rows=max_rows)
    assert torch.equal(conv_pool, pools[0]) and torch.equal(state_pool, pools[1])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    same = torch.equal if device == "cpu" else lambda mine, its: torch.allclose(mine.float(), its.float(),
                                                                                atol=tolerance, rtol=tolerance)
    for b, ((vis, _), (_, slot)) in enumerate(zip(trees, SEQUENCES, strict=True)):
        lo, n = int(row_offsets[b]), sizes[b]
        segment = slice(lo + b * (taps - 1), lo + (b + 1) * (taps - 1) + n)
        got = (out[lo:lo + n], record[0][segment], *(r[lo:lo + n] for r in record[1:]))
        if n == 0:  # a padding sequence: nothing written
            assert record[0][segment].isnan().all()
            continue
        single = (torch.empty(taps - 1 + n, conv_dim, device=device, dtype=dtype),
                  torch.empty(n, heads, d, device=device), torch.empty(n, heads, d, device=device),
                  torch.empty(n, heads, device=device))
        one = gdn.tree_step(module, proj[lo:lo + n], conv_pool[slot], state_pool[slot], single[0],
                            sources[lo:lo + n], vis.to(device), *single[1:])
        for name, mine, its in zip(("out", "inputs", "keys", "u", "decay"), got, (one, *single), strict=True):
            assert same(mine, its), (b, name)
        # the PyTorch steps of HybridFastPath's recurrent layer (conv in float32, rounded once, as the kernels)
        qkv, _, b_gate, a_gate = proj[lo:lo + n].split([conv_dim, module.value_dim, heads, heads], dim=-1)
        inputs = torch.cat([conv_pool[slot], qkv])
        window = inputs[sources[lo:lo + n]].transpose(1, 2)
        conv, beta, g = conv_and_gates(window.float(), module.conv1d.weight[:, 0].float(), b_gate, a_gate,
                                       module.A_log, module.dt_bias)
        o, keys, u, decay = tree_delta_rule(*split_heads(module, conv.to(dtype)), g, beta, vis.to(device),
                                            state_pool[slot])
        assert torch.equal(got[1], inputs), (b, "inputs")
        for name, mine, its in zip(("out", "keys", "u", "decay"), got[:1] + got[2:],
                                   (o.reshape(n, -1), keys, u, decay), strict=True):
            assert torch.allclose(mine.float(), its.float(), atol=tolerance, rtol=tolerance), \
                (b, name, (mine.float() - its.float()).abs().max())
    for r in record[1:]:  # rows after the last sequence: nothing written
        assert r[rows - PADDING:].isnan().all()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "k_heads", "d"), [(4, 2, 16), (48, 16, 128)])
def test_varlen_tree_step_equals_each_sequence_alone_on_a_gpu(dtype, heads, k_heads, d):
    """Qwen3.6-27B's widths and a tiny grouped case, compiled."""
    varlen_case(heads, k_heads, d, dtype, "cuda", max_rows=32)


@interpreted
@pytest.mark.parametrize(("heads", "k_heads", "d", "max_rows"), [(4, 2, 32, 20), (2, 1, 16, 33)])
def test_varlen_tree_step_equals_each_sequence_alone_interpreted(heads, k_heads, d, max_rows, monkeypatch):
    """Row tiles of 16 (the chain takes two), d_v slices of 16 (two at d 32); max_rows at the longest
    sequence's 20 rows, and over it (a graph's fixed bound: 64 padded columns)."""
    from ddtree.kernels import gdn

    monkeypatch.setattr(gdn, "TREE_SLICE", 16)  # at d 32: two d_v slices
    monkeypatch.setattr(gdn, "TREE_CONFIGS", dict.fromkeys(gdn.TREE_CONFIGS, (4, 16)))  # 20 rows: two row tiles
    varlen_case(heads, k_heads, d, torch.float32, "cpu", max_rows)


def commit_case(device: str) -> None:
    """Random states in a pool, a verify's record and three sequences' accepted paths (a root alone, a path of
    three rows, one of five; slots out of order, one slot untouched): the kernel's in-place commit equals
    fast/delta.path_state per sequence and layer, to float32 round-off (the kernel sums the path's outer
    products in another order than the einsum)."""
    from ddtree.fast.delta import path_state
    from ddtree.kernels import gdn

    gen = torch.Generator().manual_seed(11)
    layers, pool, heads, d_k, d_v, rows = 2, 4, 3, 32, 16, 12

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    state = rand(layers, pool, heads, d_k, d_v)
    keys, u, decay = rand(layers, rows, heads, d_k), rand(layers, rows, heads, d_v), -rand(layers, rows, heads).abs()
    paths = [[0], [1, 2, 3], [4, 6, 7, 9, 11]]  # global rows, root first
    slots = [2, 0, 3]
    want = state.clone()
    for path, slot in zip(paths, slots, strict=True):
        visible = torch.zeros(rows, rows, dtype=torch.bool, device=device)
        visible[path[-1], path] = True
        want[:, slot] = path_state(keys, u, decay, visible, state[:, slot], torch.tensor(path[-1], device=device))
    padded = torch.tensor([p + [-1] * (5 - len(p)) for p in paths], dtype=torch.int32, device=device)
    gdn.commit_states(state, torch.tensor(slots, dtype=torch.int32, device=device), keys, u, decay, padded,
                      torch.tensor([p[-1] for p in paths], dtype=torch.int32, device=device))
    torch.testing.assert_close(state, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[:, 1], want[:, 1])  # a slot no sequence holds is left as it was


@interpreted
def test_the_commit_kernel_installs_each_sequences_path_state_interpreted():
    commit_case("cpu")


@gpu
def test_the_commit_kernel_installs_each_sequences_path_state_on_a_gpu():
    commit_case("cuda")
