"""The benchmarks' timing helpers."""


import torch
from marks import interpreted


@interpreted
def test_the_read_bandwidth_kernel_reads_every_element_once():
    """`ddtree bench` times its read floor with this kernel: its sums prove it read all the bytes it counts."""
    from ddtree.bench.timing import READ_BLOCK, read_sums

    data = torch.randn(3 * READ_BLOCK, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sums = read_sums(data, torch.empty(3))
    assert torch.allclose(sums, data.float().view(3, READ_BLOCK).sum(dim=1), atol=1e-3, rtol=1e-5)
