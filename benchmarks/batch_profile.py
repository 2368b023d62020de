"""Where a batched round's wall time goes on the host: phase times and the heaviest Python functions.

Decodes `--concurrency` requests together on the batch engine (the demo pair, or a random-weight --shape), warms
up, then runs the remaining steps under cProfile. Prints the mean step time, each phase's share (draft, tree,
verify, commit as the backend times them) and the functions with the most time of their own: the host work
that the device round would remove.

    PYTHONPATH=server python benchmarks/batch_profile.py --concurrency 32 [--method ddtree] [--no-batch-budget]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from ddtree.bench.shapes import build_pair, build_shape
from ddtree.core.sampling import SamplingParams
from ddtree.engine.batch import BatchOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--method", default="ddtree", choices=["ar", "dflash", "ddtree"])
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--shape", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-budget", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = args.concurrency
    if args.shape:
        engine, _ = build_shape(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32, 512,
                                None, None, None)
    else:
        engine, _ = build_pair(None, None, str(device), None, 512, None, None, None)
    batch = engine.batch(BatchOptions(max_num_seqs=c, max_num_batched_tokens=max(2048, c * (args.budget + 1)),
                                      kv_cache_tokens=c * (64 + args.max_new_tokens + 2 * args.budget + 64),
                                      batch_budget=args.batch_budget, single_request_path=False))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for seq in range(c):
        batch.add([(seq * 7 + j) % 500 + 5 for j in range(64)], params, method=args.method, budget=args.budget)
    for _ in range(4):  # prefill and the first rounds: compiles and warm-up
        batch.step()
    phases: dict[str, float] = {}
    profiler = cProfile.Profile()
    steps, started = 0, time.perf_counter()
    profiler.enable()
    while batch.has_work():
        batch.step()
        steps += 1
        for name, seconds in batch.last.phase_seconds.items():
            phases[name] = phases.get(name, 0.0) + seconds
    profiler.disable()
    wall = time.perf_counter() - started
    print(f"{engine.model_name} on {device}, c={c} {args.method} B={args.budget} "
          f"batch budget {'on' if args.batch_budget else 'off'}: {steps} steps, {1e3 * wall / steps:.2f} ms a step "
          "(under cProfile)")
    print("phases, ms a step: " + ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in phases.items()))
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
