"""Random trees for tests: parents per node, and the ancestor masks the tree kernels and closed forms read."""

import torch


def random_tree(n: int, generator: torch.Generator) -> list[int]:
    """Parent per node (-1 for the root), each parent before its child."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


def ancestry(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The [n, n] ancestor-or-self mask and the depths of a tree given by its parents (parents first)."""
    n = len(parents)
    visible = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            visible[i] |= visible[p]
    return visible, visible.sum(1) - 1
