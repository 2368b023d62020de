"""The commit's in-place K/V compaction."""

import os
from importlib.util import find_spec

import pytest
import torch
from cases import compaction_case

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
interpreted = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1" or find_spec("triton") is None,
    reason="interpreted kernels run on CPU-only machines with Triton (a GPU compiles them)")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("path", "start"), [([0, 2, 5, 9], 7), ([0, 1, 2], 0), (list(range(0, 32, 2)), 20)])
def test_the_compaction_kernel_moves_the_path_rows_in_place_on_a_gpu(dtype, path, start):
    compaction_case(path, start, dtype, "cuda")


@interpreted
@pytest.mark.parametrize(("path", "start"), [([0, 2, 5, 9], 7), ([0, 1, 2], 0), ([0, 3, 4, 0, 0], 1)])
def test_the_compaction_kernel_moves_the_path_rows_in_place_interpreted(kernels_on_cpu, path, start):
    compaction_case(path, start, torch.float32, "cpu")
