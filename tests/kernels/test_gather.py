"""The row-gather kernel against index_select."""


import pytest
import torch
from marks import interpreted


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
