"""The acceptance walk's kernel and its PyTorch fallback."""


import pytest
import torch
from cases import walk_case
from ddtree.kernels import jit
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize(("budget", "accept_depth"), [(1, 1), (16, 0), (64, 3), (64, 15), (256, 6)])
def test_the_walk_kernel_accepts_the_path_the_picks_spell_on_a_gpu(budget, accept_depth):
    walk_case(budget, accept_depth, seed=budget + accept_depth, device="cuda")


@interpreted
@pytest.mark.parametrize(("budget", "accept_depth"), [(1, 1), (5, 0), (16, 15), (40, 3), (70, 4)])
def test_the_walk_kernel_accepts_the_path_the_picks_spell_interpreted(budget, accept_depth):
    walk_case(budget, accept_depth, seed=budget + accept_depth, device="cpu")


@interpreted
def test_a_walk_kernel_that_cannot_launch_leaves_the_walk_to_pytorch(kernels_on_cpu, monkeypatch, capsys):
    """A GPU where the walk's kernel cannot build or launch (an old Triton, too little shared memory at a large
    budget) still gets every round's right answer: `accept` takes the PyTorch steps for that shape, says so once,
    and does not try the kernel again."""
    from ddtree.kernels import walk
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
