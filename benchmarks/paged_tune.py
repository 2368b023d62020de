"""The paged attention kernel for decode rows: tiles of BLOCK_M rows a sequence against one-row tiles (`tile_rows`),
by splits of each sequence's keys, key columns a step and pipeline stages, each checked against SDPA.

Decode batches of the Qwen3-8B shape (8 K/V heads, 4 query heads each, d 128, pages of 16) at each --batches
entry (requests @ context tokens); the time is per layer call, median of replays of 36 distinct layer caches in one
CUDA graph, against the time the batch's K/V bytes take at --bandwidth. On an H100 (PDL off) a step of 32 decodes
at ~300 tokens spent 59 us a layer in this kernel, ~4.8x its bytes (benchmarks/RESULTS.md).

    PYTHONPATH=server python benchmarks/paged_tune.py [--batches 32@300 32@1600 8@300 64@300] [--bandwidth 3.2e12]
"""

from __future__ import annotations

import argparse
import functools

import torch
from ddtree.bench.timing import graph_ms
from ddtree.kernels.jit import sm_count
from ddtree.kernels.paged_attention import (
    BLOCK_M,
    PagedLayout,
    _triton_paged,
    launch_config,
    paged_attention_sdpa,
    paged_mask,
    tile_count,
    tile_rows,
)

LAYERS, KV, GROUPS, D, PAGE = 36, 8, 4, 128, 16
SPLITS, COLUMNS, STAGES = (1, 2, 3, 4, 6, 8, 16), (64, 128), (2, 3)


def decode_layout(requests: int, context: int) -> PagedLayout:
    """`requests` sequences of one new row after about `context` committed tokens, pages laid out one after another."""
    starts, offsets, tables, page0 = [], [0], [], 0
    for i in range(requests):
        start = context + 3 * i
        pages = -(-(start + 1) // PAGE)
        tables.append(list(range(page0, page0 + pages)))
        page0 += pages + 1
        starts.append(start)
        offsets.append(offsets[-1] + 1)
    return PagedLayout(starts, offsets, tables, [torch.ones(1, 1, dtype=torch.bool)] * requests)


def sweep(requests: int, context: int, bandwidth: float, caches: list[torch.Tensor]) -> None:
    device = caches[0].device
    layout = decode_layout(requests, context)
    kv_bytes = sum(s + 1 for s in layout.starts) * KV * D * 2 * caches[0].element_size()
    print(f"## {requests} decodes @ {context}: K/V {kv_bytes / 1e6:.1f} MB a layer, "
          f"{kv_bytes / bandwidth * 1e6:.1f} us at {bandwidth / 1e12:.1f} TB/s")
    q = torch.randn(KV, GROUPS * requests, D, device=device, dtype=caches[0].dtype)
    want = None
    for block_m in sorted({BLOCK_M, tile_rows(1)}, reverse=True):
        tiles = tile_count(requests, requests, block_m)  # a captured forward's padded list
        mask = paged_mask(layout, PAGE, device, tile_count=tiles, block_m=block_m)
        want = paged_attention_sdpa(q, caches[0], mask) if want is None else want
        _, auto = launch_config(requests, tiles, KV, sm_count(device), PAGE, D)
        timed = []
        for splits in sorted({*SPLITS, auto}):
            for columns in COLUMNS:
                for stages in STAGES:
                    launch = functools.partial(_triton_paged, q, mask=mask, splits=splits, block_n=columns,
                                               num_stages=stages)
                    error = (launch(cache=caches[0]).float() - want.float()).abs().max().item()
                    us = 1e3 * graph_ms(lambda launch=launch: [launch(cache=c) for c in caches]) / LAYERS
                    default = (splits, columns, stages) == (auto, 64, 2)
                    timed.append((us, f"splits {splits}, {columns} columns, {stages} stages"
                                  + (" (default)" if default else "")
                                  + (f" ERROR {error:.3f}" if error > 0.05 else "")))
        timed.sort()
        default = next(us for us, label in timed if "(default)" in label)
        print(f"  {block_m}-row tiles: default {default:.1f} us; fastest " +
              "; ".join(f"{us:.1f} us ({label})" for us, label in timed[:4]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", default=["32@300", "32@1600", "8@300", "64@300"],
                        help="requests@context of each decode batch swept")
    parser.add_argument("--bandwidth", type=float, default=3.2e12, help="bytes/s the K/V bytes are held against")
    args = parser.parse_args()
    device = torch.device("cuda")
    batches = [tuple(int(x) for x in b.split("@")) for b in args.batches]
    slots = sum(r * (c + 3 * r + PAGE + 1) for r, c in batches) + PAGE
    caches = [torch.randn(2, KV, slots, D, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]
    for requests, context in batches:
        sweep(requests, context, args.bandwidth, caches)


if __name__ == "__main__":
    main()
