"""The commit's in-place K/V compaction."""


import pytest
import torch
from cases import compaction_case
from marks import gpu, interpreted


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("path", "start"), [([0, 2, 5, 9], 7), ([0, 1, 2], 0), (list(range(0, 32, 2)), 20)])
def test_the_compaction_kernel_moves_the_path_rows_in_place_on_a_gpu(dtype, path, start):
    compaction_case(path, start, dtype, "cuda")


@interpreted
@pytest.mark.parametrize(("path", "start"), [([0, 2, 5, 9], 7), ([0, 1, 2], 0), ([0, 3, 4, 0, 0], 1)])
def test_the_compaction_kernel_moves_the_path_rows_in_place_interpreted(kernels_on_cpu, path, start):
    compaction_case(path, start, torch.float32, "cpu")
