"""Where a test runs: `gpu` tests need a CUDA device; `interpreted` ones run Triton kernels in its interpreter on
CPU-only machines (a GPU compiles the same kernels in the `gpu` twin of the test)."""

import os
from importlib.util import find_spec

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
interpreted = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1" or find_spec("triton") is None,
    reason="interpreted kernels run on CPU-only machines with Triton (a GPU compiles them)")
