"""`ddtree bench --concurrency`: output tokens per second with many requests in flight, per method, one process.

At each concurrency c the batch engine (engine/batch.py) decodes 2c requests with at most c at once (the same
prompts for every method), after one warm-up wave. Methods: `ar`; `dflash` (chains); `ddtree` at a fixed budget
(every request verifies its whole tree: --no-batch-budget); and `ddtree` under the batch budget (the round's
nodes chosen across requests by the cost model measured at start-up). Each row reports output tok/s, τ, the
mean step time, rows verified per step and requests per step; greedy rows also say whether every request's
tokens equal `ar`'s.

At the lowest concurrency `ddtree` also runs at every --budgets value: τ by budget, saved as `tau_curve` in the
JSON. Random-weight shapes accept almost nothing, so for them the cost model itself is reported (the verify
forward's time against verified tokens, and the drafter's time per request), with a projection from a τ curve
saved by a run on a real pair (`--tau-curve FILE`): the tok/s each method would reach at each concurrency. It is
labelled a projection everywhere it appears.

With --profile, each run at each concurrency also decodes a few steps under torch.profiler (bench/profile.py):
time a step by kind of layer against the bytes it reads, a table per concurrency, `profile` in each JSON row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ddtree.bench import profile
from ddtree.bench.shapes import build_pair, build_shape
from ddtree.bench.timing import measured_ceilings
from ddtree.core.budget import CostModel
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.batch import BatchEngine, BatchOptions, StepStats
from ddtree.engine.engine import placement
from ddtree.errors import DDTreeError
from ddtree.models.shapes import check_shape


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_concurrency(args: argparse.Namespace) -> int:
    device, dtype = placement(args.device, args.dtype)
    levels = sorted(set(args.concurrency))
    if any(c < 1 for c in levels):
        raise DDTreeError("--concurrency levels must be at least 1")
    if args.profile is not None and args.profile < 1:
        raise DDTreeError("--profile needs at least 1 step")
    if args.shape:
        check_shape(args.shape)
    budget = args.budgets[0] if args.budgets else 32
    log(f"building {'shape ' + args.shape if args.shape else 'pair'} on {device}")
    # the single-request path's static caches hold a whole request, as the server's do (a request alone runs there)
    capacity = args.prompt_tokens + args.max_new_tokens + 2 * max(args.budgets or [budget]) + 64
    if args.shape:
        engine, _ = build_shape(args.shape, device, dtype, capacity, args.draft_vocab, args.draft_quantization,
                                args.quantization)
    else:
        engine, _ = build_pair(args.target, args.draft, str(device), args.dtype, capacity, args.draft_vocab,
                               args.draft_quantization, args.quantization)
    prompts = _prompts(engine, args, 2 * max(levels))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=True)
    top = max(levels)
    tokens = max(args.max_num_batched_tokens, top * (budget + 1))
    pool = top * (args.prompt_tokens + args.max_new_tokens + 2 * budget + 64)
    solo = args.single_request_path
    # every run decodes the same prompts (after a warm-up wave of them): with prefix caching the later runs would
    # skip the prefills the first paid for, so each prompt is prefilled every time, as the runs compare decoding
    fixed = engine.batch(BatchOptions(max_num_seqs=top, max_num_batched_tokens=tokens, kv_cache_tokens=pool,
                                      batch_budget=False, single_request_path=solo, prefix_caching=False))
    budgeted = engine.batch(BatchOptions(max_num_seqs=top, max_num_batched_tokens=tokens, kv_cache_tokens=pool,
                                         single_request_path=solo, prefix_caching=False))
    cost = getattr(budgeted.backends[0], "cost", None)
    runs = [("ar", None, fixed), ("dflash", None, fixed), ("ddtree", budget, fixed), ("ddtree batch", budget, budgeted)]
    curve_runs = [("ddtree", b, fixed) for b in args.budgets[1:]]
    rows, tau_curve, profiled = [], {}, []
    for c in levels:
        ar_outputs = None
        for i, (label, b, batch) in enumerate(runs + (curve_runs if c == levels[0] else [])):
            method = label.split()[0]
            row = _run(batch, prompts[:2 * c], params, method, b, c)
            row.update(concurrency=c, method=label, budget=b)
            if label == "ar":
                ar_outputs = row["outputs"]
            row["same_as_ar"] = row.pop("outputs") == ar_outputs if params.greedy else None
            if i < len(runs):
                profiled.append((row, method, b, batch))
            rows.append(row)
            if c == levels[0] and label != "ddtree batch":
                tau_curve["0" if label == "ar" else "chain" if label == "dflash" else str(b)] = row["tau"]
            log(f"c={c} {label}{' B=' + str(b) if b else ''}: {row['tokens_per_second']:.0f} tok/s, "
                f"tau {row['tau']:.2f}, step {row['step_ms']:.2f} ms, {row['rows_per_step']:.0f} rows")
    if args.profile:  # after every measurement: the profiler's overhead must not reach the batch budget's model
        sizes, ceilings = profile.Sizes.of(engine), measured_ceilings(device)
        for row, method, b, batch in profiled:
            row["profile"] = profile.profile_batch(batch, prompts[:row["concurrency"]], params, method, b, device,
                                                   sizes, ceilings, args.profile)
    report = dict(model=args.shape or engine.model_name, device=torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", prompt_tokens=args.prompt_tokens,
                  max_new_tokens=args.max_new_tokens, budget=budget, results=rows, tau_curve=tau_curve,
                  cost_model=None if cost is None else dict(points=cost.points, per_request=cost.per_request))
    if cost is not None and len(cost.points) > 1 and args.tau_curve:
        with open(args.tau_curve) as f:
            curve = json.load(f)["tau_curve"]
        report["projection"] = projection(cost, levels, curve, engine.block_size - 1)
        report["projection_tau_curve"] = args.tau_curve
    print(table(report))
    if args.profile:
        print("\n" + profile.concurrency_tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _prompts(engine: Engine, args: argparse.Namespace, count: int) -> list[list[int]]:
    from ddtree.bench.command import prompts_for

    asked = argparse.Namespace(**{**vars(args), "prompts": count})
    prompts = prompts_for(engine, asked)
    if not prompts:
        raise DDTreeError("no prompts (no held-out files long enough in --corpus)")
    return [prompts[i % len(prompts)] for i in range(count)]


def _run(batch: BatchEngine, prompts: list[list[int]], params: SamplingParams, method: str, budget: int | None,
         concurrency: int) -> dict:
    """Decode `prompts` with at most `concurrency` in flight (a warm-up wave first); tok/s over the whole wave."""
    def wave(ps: list[list[int]]) -> tuple[list, float, list]:
        pending, seqs, steps = list(ps), [], []
        started = time.perf_counter()
        while pending or batch.has_work():
            while pending and batch.running + batch.waiting < concurrency:
                seq = batch.add(pending.pop(0), params, method=method, budget=budget)
                seqs.append(seq)
            batch.step()
            steps.append((batch.last, getattr(batch.backends[0], "last_predicted", None)))
        return seqs, time.perf_counter() - started, steps

    wave(prompts[:min(len(prompts), concurrency)])
    seqs, seconds, steps = wave(prompts)
    generated = sum(len(s.generation.token_ids) for s in seqs)
    rounds = sum(s.generation.stats.rounds for s in seqs)
    committed = sum(s.generation.stats.committed_tokens for s in seqs)
    decode = [(stats, predicted) for stats, predicted in steps if stats.sequences]
    count = max(len(decode), 1)
    rows, requests = (sum(getattr(s, key) for s, _ in decode) / count for key in ("verified_tokens", "sequences"))
    # the batch budget's model of a round (a device round's measured time, else verify + per request; plus the
    # overhead it measures while serving), on average over the steps that ran rounds alone (no prompt chunks: the
    # model prices a round, not the prefills beside it), against those steps' measured time
    rounds_only = [(s, p) for s, p in decode if not s.prefill_tokens]
    predictions = [p for _, p in rounds_only if p is not None]
    predicted = 1e3 * sum(predictions) / len(predictions) if predictions else None
    return dict(tokens_per_second=generated / seconds, tau=committed / max(rounds, 1),
                step_ms=1e3 * sum(s.seconds for s, _ in decode) / count, predicted_step_ms=predicted,
                round_ms=1e3 * sum(s.seconds for s, _ in rounds_only) / len(rounds_only) if rounds_only else None,
                rows_per_step=rows, requests_per_step=requests, phase_ms=phase_ms([s for s, _ in decode]),
                outputs=[s.generation.token_ids for s in seqs])


def phase_ms(steps: list[StepStats]) -> dict[str, float]:
    """Milliseconds a decode step spends in each phase (draft, tree, verify, commit), on average: where a slow
    step's time goes. Only the draft phase waits for the device, so queued device work lands in the phase that
    next waits."""
    totals: dict[str, float] = {}
    for step in steps:
        for name, seconds in step.phase_seconds.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {name: 1e3 * seconds / max(len(steps), 1) for name, seconds in totals.items()}


def projection(cost: CostModel, levels: list[int], tau: dict, depth: int) -> list[dict]:
    """A PROJECTION, not a measurement: tok/s = c * τ(b) / round time(c * (1 + nodes(b)), c) for `ar` (b = 0),
    `dflash` (a chain of the block's depth) and each budget b of the τ curve, and the best of them (what the
    batch budget aims at). Round times come from the measured cost model; τ from the named curve."""
    out = []
    for c in levels:
        entry = {"concurrency": c}
        for key, t in tau.items():
            nodes = depth if key == "chain" else int(key)
            entry[f"tau {key}"] = c * t / cost.seconds(c * (1 + nodes), c)
        entry["best"] = max(v for k, v in entry.items() if k.startswith("tau "))
        out.append(entry)
    return out


def table(report: dict) -> str:
    lines = [f"{report['model']} on {report['device']}: {report['prompt_tokens']} prompt tokens, "
             f"{report['max_new_tokens']} new, ddtree budget {report['budget']}", "",
             "| concurrency | method | output tok/s | tau | step ms | round ms | predicted ms | rows/step "
             "| requests/step | == ar | ms by phase |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        same = "" if r["same_as_ar"] is None else "yes" if r["same_as_ar"] else "NO"
        predicted, alone = ("" if r.get(k) is None else f"{r[k]:.2f}" for k in ("predicted_step_ms", "round_ms"))
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['tokens_per_second']:.0f} | {r['tau']:.2f} | "
                     f"{r['step_ms']:.2f} | {alone} | {predicted} | {r['rows_per_step']:.0f} | "
                     f"{r['requests_per_step']:.1f} | "
                     f"{same} | {', '.join(f'{k} {v:.2f}' for k, v in r.get('phase_ms', {}).items())} |")
    if report.get("cost_model") and len(report["cost_model"]["points"]) > 1:
        model = report["cost_model"]
        lines += ["", "cost model (measured): verify ms by rows: " + ", ".join(
            f"{t}: {1e3 * s:.2f}" for t, s in model["points"]) + f"; per request {1e3 * model['per_request']:.3f} ms"]
    if report.get("projection"):
        keys = [k for k in report["projection"][0] if k.startswith("tau ")]
        lines += ["", "PROJECTION (tok/s from the measured cost model and the named tau curve, not measured):", "",
                  "| concurrency | " + " | ".join(keys) + " | best |", "|---" * (len(keys) + 2) + "|"]
        for p in report["projection"]:
            lines.append(f"| {p['concurrency']} | " + " | ".join(f"{p[k]:.0f}" for k in keys) + f" | {p['best']:.0f} |")
    return "\n".join(lines)
