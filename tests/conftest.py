"""Suite-wide settings."""

import os

import torch

# Without a GPU, Triton's interpreter runs the fast path's kernels on the CPU (tests/fast/test_kernels_cpu.py);
# it must be on before any kernel is defined, i.e. before a test module imports ddtree.fast.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The models under test are tiny: one intra-op thread is faster than two fighting for CI's two cores.
torch.set_num_threads(1)
