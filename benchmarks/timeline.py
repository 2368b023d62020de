"""Which kernels a replayed round waits on: each kernel's share of the round's critical path, from a timeline.

Summed kernel durations (profile_fast.py) overlap under programmatic dependent launch and count the time a kernel
waits for the one before, so they do not say what a step costs a round. This replays a round's CUDA graphs under
torch.profiler and walks its kernels in start order: each adds to the round what its end passes the latest end
before it (its increment), and a gap with no kernel running is the round's idle time. The increments and the
idle sum to the round's span, so a kind's total is what the round would lose if that kind ended with the kernel
before it.

    PYTHONPATH=server python benchmarks/timeline.py --shape qwen3-8b --budgets 64 \
        --draft-vocab 16384 --draft-quantization fp8 [--layer 18]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import torch
from ddtree.bench.shapes import build_shape
from ddtree.core.sampling import SamplingParams
from torch.profiler import ProfilerActivity, profile


def kernels_of(prof: profile) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every device kernel in a profile, in start order."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    found = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace["traceEvents"]
             if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(found, key=lambda k: k[1])


def short(name: str) -> str:
    """A kernel's name without its template arguments."""
    return name.split("<")[0].split("(")[0].replace("void ", "")[:40]


def increments(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float, float]]:
    """(name, start, end, increment, idle before it) per kernel: what its end adds past every end before it, and
    the gap before its start with nothing running."""
    out, latest = [], kernels[0][1] if kernels else 0.0
    for name, start, end in kernels:
        idle = max(0.0, start - latest)
        out.append((name, start, end, max(0.0, end - max(latest, start)), idle))
        latest = max(latest, end)
    return out


def report(engine, method: str, budget: int, prompt: list[int], rounds: int, layer: int) -> None:
    """Print one plan's critical-path share per kernel kind (µs per round), and for a tree whose projections run on
    the Hopper GEMM (33-136 rows), one target layer's kernels in order."""
    fast = engine.fast
    engine.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True), method=method, budget=budget)
    plan = fast.plan(method, budget)
    fast.prefill(torch.tensor(prompt, device=fast.device), with_draft=method != "ar")
    for _ in range(3):
        plan.run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            plan.run()
        torch.cuda.synchronize()
    timeline = increments(kernels_of(prof))
    span = (timeline[-1][2] - timeline[0][1]) if timeline else 0.0
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for name, start, end, inc, _ in timeline:
        kind = by_kind[short(name)]
        kind[0] += inc / rounds
        kind[1] += (end - start) / rounds
        kind[2] += 1 / rounds
    idle_total = sum(t[4] for t in timeline) / rounds
    print(f"\n{method} B={budget}: {len(timeline) / rounds:.0f} kernels a round, span {span / rounds:.1f} µs a round "
          f"(idle {idle_total:.1f})")
    print("| kernel | on the critical path, µs | summed durations, µs | launches |\n|---|---|---|---|")
    for kind, (inc, dur, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {kind} | {inc:.1f} | {dur:.1f} | {count:.0f} |")
    per_round = len(timeline) // rounds
    last = timeline[per_round * (rounds - 1):]  # the last round
    gemms = [i for i, k in enumerate(last) if short(k[0]).startswith("wgmma")]  # 4 a layer, then the LM head
    if method != "ddtree" or len(gemms) < 4 * (layer + 2):
        return
    first, stop = gemms[4 * layer] - 1, gemms[4 * (layer + 1)] - 1  # from the norm before its q/k/v
    t0 = last[first][1]
    print(f"\nlayer {layer} of the last round (µs from its first kernel's start):")
    print("| kernel | start | end | duration | increment | idle before |\n|---|---|---|---|---|---|")
    for name, start, end, inc, idle in last[first:stop]:
        print(f"| {short(name)} | {start - t0:.2f} | {end - t0:.2f} | {end - start:.2f} | {inc:.2f} | {idle:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64])
    parser.add_argument("--methods", nargs="+", default=["ar", "ddtree"], choices=["ar", "dflash", "ddtree"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layer", type=int, default=18,
                        help="the target layer whose kernels are listed (trees of 32-135 nodes)")
    parser.add_argument("--draft-vocab")
    parser.add_argument("--draft-quantization", choices=["fp8"])
    args = parser.parse_args()
    engine, _ = build_shape(args.shape, torch.device("cuda"), torch.bfloat16, args.prompt_tokens + 256,
                            args.draft_vocab, args.draft_quantization)
    prompt = torch.randint(0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    for method in args.methods:
        for budget in (args.budgets if method == "ddtree" else [1]):
            report(engine, method, budget, prompt, args.rounds, args.layer)


if __name__ == "__main__":
    main()
