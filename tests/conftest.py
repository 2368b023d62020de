"""Suite-wide settings."""

import torch

# The models under test are tiny: one intra-op thread is faster than two fighting for CI's two cores.
torch.set_num_threads(1)
