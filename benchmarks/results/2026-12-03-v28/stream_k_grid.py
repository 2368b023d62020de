"""Diagnostic for the stream-K try (stream_k.patch applied): the 8B's fused q/k/v at 65 rows, unsplit against
stream-K dealt out to 96 (one whole tile a block, no partials), 128 and 132 blocks; µs per call as wgmma_probe.py
times them (36 calls cycling over distinct weights, one CUDA graph).

    PYTHONPATH=server python benchmarks/results/2026-12-03-v28/stream_k_grid.py
"""

import dataclasses
import types

import torch
from ddtree.fast import wgmma
from ddtree.fast.bench import cycled_us, weight_copies

weights = weight_copies(6144, 4096)
x = torch.randn(65, 4096, device="cuda", dtype=torch.bfloat16)
plain = dataclasses.replace(wgmma.launch_config(6144, 4096, 65), stream=False)
want = wgmma.linear(x, weights[0], plain)
real = torch.cuda.get_device_properties
for label, blocks in (("unsplit", None), ("stream-K 96", 96), ("stream-K 128", 128), ("stream-K 132", 132)):
    config = plain if blocks is None else dataclasses.replace(plain, stream=True)
    if blocks is not None:  # linear() deals the units out to multi_processor_count blocks
        wgmma.torch.cuda.get_device_properties = lambda d, n=blocks: types.SimpleNamespace(multi_processor_count=n)
    got = wgmma.linear(x, weights[0], config)
    us = cycled_us(lambda w, c=config: wgmma.linear(x, w, c), weights)
    wgmma.torch.cuda.get_device_properties = real
    print(
        f"| {label} | {us:.1f} | max diff to unsplit {(got.float() - want.float()).abs().max().item():.3g} |",
        flush=True,
    )
