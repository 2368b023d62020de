"""What a batched step costs with and without prompt rows in it: N requests decoding alone, the same N beside a
new request's P-token prompt (a prefix hit's new rows, say), and 4N decoding, through the batch engine as the server
runs it. A step that carries prompt rows beside a round should cost the round plus the prompt rows' compute; on an
H100 (Qwen3-8B shape, ar) it cost two decode steps, because the prompt's forward and the round's each read every
weight (benchmarks/RESULTS.md). `--profile` adds torch.profiler's kernel table of each kind of step.

    PYTHONPATH=server python benchmarks/mixed_steps.py --shape qwen3-8b [--decodes 8] [--prompt 75] [--profile]
    PYTHONPATH=server python benchmarks/mixed_steps.py            # the demo pair (CPU or GPU)
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch
from ddtree.bench.timing import sync
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.batch import BatchEngine, BatchOptions, warm_up


def timed_step(batch: BatchEngine, device: torch.device) -> float:
    sync(device)
    started = time.perf_counter()
    batch.step()
    sync(device)
    return 1e3 * (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", help="a random-weight shape (models/shapes.py) instead of the demo pair")
    p.add_argument("--method", choices=["ddtree", "dflash", "ar"], default="ar")
    p.add_argument("--decodes", type=int, default=8, help="requests decoding (N)")
    p.add_argument("--prompt", type=int, default=75, help="tokens of the prompt that joins them (P)")
    p.add_argument("--context", type=int, default=300, help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=6, help="steps timed of each kind")
    p.add_argument("--profile", action="store_true", help="also print each kind of step's CUDA/CPU kernel table")
    args = p.parse_args()
    load = functools.partial(Engine.from_shape, args.shape) if args.shape else Engine.from_pretrained
    engine = load(device=args.device, fast=True, method=args.method)
    device = engine.target.device
    batch = engine.batch(BatchOptions(kv_cache_tokens=200_000, max_num_seqs=max(64, 4 * args.decodes)))
    warm_up(batch, SamplingParams())
    rng = random.Random(0)
    decoding = SamplingParams(max_new_tokens=10_000, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, engine.vocab_size) for _ in range(n)]

    def join(count: int) -> None:  # `count` more requests, each past its prefill
        seqs = [batch.add(prompt(args.context), decoding) for _ in range(count)]
        while any(not s.generation.token_ids for s in seqs):
            batch.step()

    def alone() -> float:
        return timed_step(batch, device)

    def beside_a_prompt() -> float:
        batch.add(prompt(args.prompt), SamplingParams(max_new_tokens=1, ignore_eos=True))
        ms = timed_step(batch, device)
        batch.step()  # the one-token request finishes
        return ms

    n = args.decodes
    kinds = [(f"{n} decoding", n, alone), (f"{n} decoding beside a {args.prompt}-token prompt", 0, beside_a_prompt),
             (f"{4 * n} decoding", 3 * n, alone)]  # (name, requests that join before it, one step)
    rows = []
    for name, joining, step in kinds:
        join(joining)
        times = [step() for _ in range(args.steps)]
        rows.append((name, statistics.median(times), min(times), max(times)))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                step()
            print(f"## {name}\n" + prof.key_averages().table(
                sort_by="cuda_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=20))
    print(f"{args.shape or 'demo pair'}, {args.method}, {device}: ms a step (median, min-max of {args.steps})")
    for name, median, low, high in rows:
        print(f"  {name:45s} {median:8.2f}  ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
