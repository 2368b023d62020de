"""The GPU fast path: static caches, fused layers and rounds replayed as CUDA graphs (runner.py), over the
kernels of ddtree.kernels.
"""
