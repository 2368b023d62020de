"""The row-gather kernel against index_select."""

import os
from importlib.util import find_spec

import pytest
import torch

interpreted = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1" or find_spec("triton") is None,
    reason="interpreted kernels run on CPU-only machines with Triton (a GPU compiles them)")


@interpreted
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
