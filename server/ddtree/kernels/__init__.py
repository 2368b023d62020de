"""Every Triton and CUDA kernel of the fast path, with its launch helpers and PyTorch fallbacks.

A leaf: imports nothing else of ddtree but its errors and switches. The fast runner (ddtree.fast) composes
these into layers and rounds.
"""
