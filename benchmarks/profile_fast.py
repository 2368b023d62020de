"""Where a fast-path round's time goes on a GPU: kernel time by step and by kernel, against the GEMM-only floor.

Builds a random-weight shape (as `ddtree bench --shape`), decodes once per method to capture the graphs,
then profiles replayed rounds with torch.profiler. Prints, per method: wall time per round, the summed
kernel time per step (what the graph replays cost on the GPU) and the heaviest kernels; and the time of
the target's projections alone (every linear of every layer plus the LM head, replayed as one CUDA graph)
at 1 and at B+1 rows: the floor that cuBLAS' GEMMs set for one step before any other kernel. With
`--by-step`, also each step on its own: its graph replay time, and every kernel it launches.

    PYTHONPATH=server python benchmarks/profile_fast.py --shape qwen3-8b --budgets 64 [--by-step] \
        [--draft-vocab 16384 --draft-quantization fp8]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch
import torch.nn.functional as F
from ddtree.bench.shapes import build_shape
from ddtree.bench.timing import graph_ms
from ddtree.core.sampling import SamplingParams
from ddtree.fast.hybrid import HybridFastPath
from torch.profiler import ProfilerActivity, profile


def gemm_floor(fast, rows: int) -> float:
    """ms for every projection of one target step (fused qkv, o, gate_up, down per layer; LM head) at `rows` rows."""
    hidden = fast.target.config.hidden_size
    x = torch.randn(rows, hidden, device=fast.device, dtype=fast.dtype)
    inter = torch.randn(rows, fast.layers[0].down.weight.shape[1], device=fast.device, dtype=fast.dtype)
    attn = torch.randn(rows, fast.layers[0].o.weight.shape[1], device=fast.device, dtype=fast.dtype)

    def step() -> None:
        for layer in fast.layers:
            F.linear(x, layer.qkv.weight)
            F.linear(attn, layer.o.weight)
            F.linear(x, layer.gate_up.weight)
            F.linear(inter, layer.down.weight)
        fast.target.lm_head(x)

    return graph_ms(step)


def count_kernels(prof, rounds: int, times: dict[str, float], launches: dict[str, float]) -> None:
    """Add a profile's device kernels, by name, to `times` (ms per round) and `launches` (per round)."""
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            name = evt.name[:90]
            times[name] += evt.device_time / 1e3 / rounds
            launches[name] += 1 / rounds


def step_kernels(plan, rounds: int) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Per step: each kernel's device ms and launches per round, the step run eagerly under a profiler of its
    own (the steps before it run outside, so it reads real inputs)."""
    found = {name: (defaultdict(float), defaultdict(float)) for name, _ in plan.steps}
    with torch.inference_mode():
        for _ in range(rounds):
            out = None
            for name, fn in plan.steps:
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    out = fn(out)
                    torch.cuda.synchronize()
                count_kernels(prof, rounds, *found[name])
    return found


def profile_rounds(engine, method: str, budget: int, prompt: list[int], rounds: int, top_kernels: int,
                   ops: bool = False, by_step: bool = False) -> dict:
    """Wall time of replayed rounds (graphs), and the kernels of the same steps run eagerly (time and launches),
    per round; with `by_step`, each step's replay time and kernels."""
    fast = engine.fast
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    engine.generate(prompt, params, method=method, budget=budget)  # captures the plan
    plan = fast.plan(method, budget)
    fast.prefill(torch.tensor(prompt, device=fast.device), with_draft=method != "ar")
    for _ in range(3):
        plan.run()
    torch.cuda.synchronize()
    walls, step_walls = [], defaultdict(list)
    for _ in range(rounds):
        _, phases = plan.run()
        walls.append(sum(phases.values()))
        for name, seconds in phases.items():
            step_walls[name].append(1e3 * seconds)
    def eager_rounds() -> None:
        for _ in range(rounds):
            out = None
            for _, fn in plan.steps:
                out = fn(out)
        torch.cuda.synchronize()

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:  # eager steps: kernel times
        eager_rounds()
    by_kernel: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    count_kernels(prof, rounds, by_kernel, launches)
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top_kernels]
    if ops:  # which PyTorch ops (and input shapes) launch the kernels: a pass of its own, since tracing the CPU
        # side adds annotation ranges to the device events that would count twice in the totals above
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                             record_shapes=True) as op_prof:
            eager_rounds()
        print(f"{method} B={budget}:", op_prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_device_time_total", row_limit=top_kernels, max_name_column_width=60,
            max_shapes_column_width=70))
    steps = {}
    if by_step:
        for name, (times, counts) in step_kernels(plan, rounds).items():
            steps[name] = dict(replay_ms=statistics.median(step_walls[name]), kernel_ms=sum(times.values()),
                               launches=sum(counts.values()),
                               kernels=[(k, round(ms, 4), counts[k]) for k, ms in
                                        sorted(times.items(), key=lambda kv: -kv[1])])
    return dict(method=method, budget=budget, wall_ms=1e3 * statistics.median(walls), kernel_ms=sum(by_kernel.values()),
                launches=sum(launches.values()), graphs=plan.eager_reason or "graphs",
                top=[(name, round(ms, 4), launches[name]) for name, ms in top], steps=steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree"], choices=["ar", "dflash", "ddtree"])
    parser.add_argument("--top", type=int, default=12, help="kernels listed per method")
    parser.add_argument("--ops", action="store_true", help="also the PyTorch ops behind the kernels, with shapes")
    parser.add_argument("--by-step", action="store_true", help="also each step's replay time and all its kernels")
    parser.add_argument("--draft-vocab", help="as ddtree bench's: a file of ids, or N for the N lowest ids")
    parser.add_argument("--draft-quantization", choices=["fp8"])
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    engine, _ = build_shape(args.shape, device, torch.bfloat16, args.prompt_tokens + 256, args.draft_vocab,
                            args.draft_quantization)
    prompt = torch.randint(0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    plans = [(m, b) for m in args.methods for b in (args.budgets if m == "ddtree" else [1])]
    hybrid = isinstance(engine.fast, HybridFastPath)  # its layers are not `gemm_floor`'s
    report = dict(shape=args.shape, compiled=engine.fast.ops.compiled,
                  gemm_floor_ms={} if hybrid else
                  {rows: gemm_floor(engine.fast, rows) for rows in [1, *(b + 1 for b in args.budgets)]},
                  runs=[profile_rounds(engine, m, b, prompt, args.rounds, args.top, args.ops, args.by_step)
                        for m, b in plans])
    for run in report["runs"]:
        print(f"\n{run['method']} B={run['budget']} ({run['graphs']}): wall {run['wall_ms']:.3f} ms/round, "
              f"kernels {run['kernel_ms']:.3f} ms in {run['launches']:.0f} launches")
        for name, ms, count in run["top"]:
            print(f"  {ms:8.4f} ms  {count:5.0f}x  {name}")
        for step, seen in run["steps"].items():
            print(f"  {step}: replay {seen['replay_ms']:.4f} ms, kernels {seen['kernel_ms']:.4f} ms in "
                  f"{seen['launches']:.0f} launches")
            for name, ms, count in seen["kernels"]:
                print(f"    {ms:8.4f} ms  {count:5.1f}x  {name}")
    if report["gemm_floor_ms"]:
        print("\nGEMM-only floor (ms):", {k: round(v, 3) for k, v in report["gemm_floor_ms"].items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
