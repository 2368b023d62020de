"""`ddtree bench`: ar, dflash and ddtree side by side, in one process, on the same prompts.

For each decoding path (`fast`: ddtree.fast, static caches and CUDA graphs; `eager`: the reference loop) and
each method, every prompt is decoded after a warm-up: greedily by default, where outputs must equal `ar`'s;
or sampled (`--temperature`, `--top-p`, `--top-k`, `--min-p`; prompt i seeded with seed + i), as most
OpenAI clients ask, where only the speed and τ are compared (samples of one distribution differ). Reported per run:
TPOT, tokens/s, τ, the mean time per round of each phase (draft, tree, verify, commit, host = the rest of
the round's wall time), round time and verify time relative to one AR step on the same path, and the
batch-1 bandwidth floor of one target step (weights + KV + recurrent state, see weight_bytes).

Models: a target/draft pair from disk (default: the embedded demo pair, real τ) or `--shape NAME`, a
random-weight target and DFlash draft of a published shape, built on the GPU in bf16 (per-round costs; τ
is meaningless there): `qwen3-8b` (Qwen3-8B + Qwen3-8B-DFlash-b16) or `qwen3.6-27b` (the Qwen3.6-27B text
stack, 48 Gated DeltaNet + 16 gated attention layers, + its DFlash draft); `tiny` and `tiny-hybrid` are
their smoke-test miniatures. Where the fast path declines a target (see ddtree.fast.support), the bench
runs the eager path only, says so on stderr and reports `fast_path: "declined: <reason>"`.

With --profile, each fast-path run also decodes a few rounds of one request under torch.profiler
(bench/profile.py): time a round by kind of layer against the bytes it reads, as a table and as `profile` in
the run's JSON.
"""


from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from dataclasses import replace

import torch

from ddtree.bench import profile
from ddtree.bench.shapes import build_pair, build_shape
from ddtree.bench.timing import draft_bytes, floors, measured_ceilings, weight_bytes
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.engine import placement
from ddtree.errors import DDTreeError
from ddtree.models.shapes import check_shape


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompts_for(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    """Held-out source files for a real pair (text it never trained on); random ids for a random-weight shape."""
    if args.shape:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.target.shape.vocab_size
        return [torch.randint(0, vocab - 2, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    from ddtree.training.corpus import find_files, read_texts, split_files

    _, held = split_files(find_files([args.corpus or sysconfig.get_paths()["stdlib"]], ["*.py"]))
    texts = [t for t in read_texts(held) if len(t) > 4 * args.prompt_tokens][:args.prompts]
    return [engine.encode(t)[:args.prompt_tokens] for t in texts]


def run(engine: Engine, prompts: list[list[int]], method: str, budget: int, params: SamplingParams) -> dict:
    """Decode every prompt (after one warm-up that also captures the graphs, and compiles the steps the first
    time: its wall time is `warmup_s`, what a server's warm-up costs per plan); totals and per-round means."""
    started = time.perf_counter()
    engine.generate(prompts[0], replace(params, max_new_tokens=16), method=method, budget=budget)
    warmup_s = time.perf_counter() - started
    totals = dict(rounds=0, committed=0, decoded=0, seconds=0.0)
    phases: dict[str, float] = {}
    outputs, on_fast = [], True
    for i, ids in enumerate(prompts):
        seed = None if params.seed is None else params.seed + i
        gen = engine.stream(ids, replace(params, seed=seed), method=method, budget=budget)
        on_fast &= gen.backend.name == "fast"
        for _ in gen:
            pass
        s = gen.stats
        outputs.append(gen.token_ids)
        totals["rounds"] += s.rounds
        totals["committed"] += s.committed_tokens
        totals["decoded"] += max(s.generated_tokens - 1, 0)
        totals["seconds"] += s.decode_seconds
        for name, seconds in s.phase_seconds.items():
            phases[name] = phases.get(name, 0.0) + seconds
    rounds = max(totals["rounds"], 1)
    per_round = {name: 1e3 * seconds / rounds for name, seconds in phases.items()}
    per_round["host"] = per_round.get("host", 0.0) + max(1e3 * totals["seconds"] / rounds - sum(per_round.values()), 0)
    round_ms = 1e3 * totals["seconds"] / rounds
    graphs = None
    if on_fast and engine.fast:
        graphs = engine.fast.plan_for(method, budget, params).eager_reason or "graphs"
    return dict(method=method, budget=budget if method == "ddtree" else None, on_fast_path=on_fast, graphs=graphs,
                tau=totals["committed"] / rounds, tpot_ms=1e3 * totals["seconds"] / max(totals["decoded"], 1),
                tokens_per_second=totals["decoded"] / totals["seconds"] if totals["seconds"] else 0.0,
                round_ms=round_ms, phase_ms=per_round,
                non_verify_share=1 - per_round.get("verify", 0.0) / round_ms if round_ms else 0.0,
                rounds=totals["rounds"], warmup_s=warmup_s, outputs=outputs)


def bench(args: argparse.Namespace) -> int:
    device, dtype = placement(args.device, args.dtype)
    if args.shape:
        check_shape(args.shape)
    if any(b < 1 for b in args.budgets):
        raise DDTreeError("budgets must be >= 1")
    if args.profile is not None and args.profile < 1:
        raise DDTreeError("--profile needs at least 1 step")
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=True,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                repetition_penalty=args.repetition_penalty, logprobs=args.logprobs)
    except ValueError as exc:
        raise DDTreeError(str(exc)) from None
    capacity = args.prompt_tokens + args.max_new_tokens + max(args.budgets) + 64
    log(f"building {'shape ' + args.shape if args.shape else 'pair'} on {device}")
    if args.shape:
        fast, eager = build_shape(args.shape, device, dtype, capacity, args.draft_vocab, args.draft_quantization,
                                  args.quantization)
    else:
        fast, eager = build_pair(args.target, args.draft, str(device), args.dtype, capacity, args.draft_vocab,
                                 args.draft_quantization, args.quantization)
    paths = paths_to_run(args.paths, fast)
    prompts = prompts_for(fast, args)
    if not prompts:
        raise DDTreeError("no prompts (no held-out files long enough in --corpus)")
    ceilings = [measured_ceilings(device)]
    context = args.prompt_tokens + args.max_new_tokens // 2
    step_bytes = weight_bytes(fast, context)
    runs = [(m, b) for m in args.methods for b in (args.budgets if m == "ddtree" else [0])]
    results = []
    for path in paths:
        engine = fast if path == "fast" else eager
        for method, budget in runs:
            log(f"{path} {method}{' B=' + str(budget) if budget else ''} ...")
            t = time.perf_counter()
            r = run(engine, prompts, method, budget or 1, params)
            r["path"] = path
            results.append(r)
            log(f"  {r['tokens_per_second']:.1f} tok/s, tau {r['tau']:.2f} (warm-up {r['warmup_s']:.1f} s, "
                f"{time.perf_counter() - t:.1f} s in all)")
    for r in results:
        ar = next((a for a in results if a["path"] == r["path"] and a["method"] == "ar"), None)
        compare = ar is not None and params.greedy  # samples are compared by τ and speed, not token by token
        r["lossless"] = r["outputs"] == ar["outputs"] if compare else None
        r["prefix_match"] = prefix_match(r["outputs"], ar["outputs"]) if compare else None
        r["round_vs_ar_step"] = r["round_ms"] / ar["round_ms"] if ar else None
        r["verify_vs_ar_step"] = r["phase_ms"].get("verify", 0.0) / ar["phase_ms"]["verify"] if ar else None
    ceilings.append(measured_ceilings(device))
    copy, read = (max((c[i] for c in ceilings if c[i]), default=None) for i in (0, 1))
    round_bytes = step_bytes + draft_bytes(fast, context)
    floor_ms = floors(step_bytes, copy, read)
    round_floor_ms = floors(round_bytes, copy, read)
    achievable = list(floor_ms)[-1]  # the tightest: read, else copy, else the datasheet
    for r in results:
        floor = (floor_ms if r["method"] == "ar" else round_floor_ms)[achievable]
        r["round_vs_floor"] = r["round_ms"] / floor
    profiled = [r for r in results if r["path"] == "fast"] if args.profile else []
    for r in profiled:
        r["profile"] = profile.profile_single(fast, prompts[0], params, r["method"], r["budget"] or 1, device,
                                              profile.Sizes.of(fast), (copy, read), args.profile)
    report = dict(model=args.shape or fast.model_name, device=torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", dtype=str(fast.target.dtype).removeprefix("torch."),
                  torch=torch.__version__, prompts=len(prompts),
                  prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, sampling=describe(params),
                  vocab_size=fast.vocab_size, draft_vocab=fast.draft_head.size if fast.draft_head else None,
                  draft_quantization=fast.draft_quantization, quantization=fast.target.quantization,
                  step_bytes=step_bytes, round_bytes=round_bytes,
                  copy_bandwidth=copy, read_bandwidth=read, floor_ms=floor_ms, round_floor_ms=round_floor_ms,
                  round_vs_floor_at=achievable, draft_share_of_round_floor=1 - step_bytes / round_bytes,
                  fast_path="available" if fast.fast else f"declined: {fast.fast_unsupported}", results=results)
    if len(paths) == 2 and "ar" in args.methods and params.greedy:
        fast_ar, eager_ar = (next(r for r in results if r["path"] == p and r["method"] == "ar") for p in paths)
        report["fast_vs_eager_ar_prefix_match"] = prefix_match(fast_ar["outputs"], eager_ar["outputs"])
    for r in results:
        r.pop("outputs")
    print(table(report))
    if profiled:
        print("\n" + profile.table("profile, fast path, one request", [
            (profile.label(r["method"], r["budget"]), r["profile"]) for r in profiled]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def describe(params: SamplingParams) -> str:
    """The decoding the runs used, in words: "greedy" or "sampled at temperature 0.8, top-p 0.95, seed 0",
    then any penalties and logprobs ("greedy, presence penalty 0.5, logprobs 5")."""
    extras = [f"presence penalty {params.presence_penalty:g}"] if params.presence_penalty else []
    extras += [f"frequency penalty {params.frequency_penalty:g}"] if params.frequency_penalty else []
    extras += [f"repetition penalty {params.repetition_penalty:g}"] if params.repetition_penalty != 1 else []
    extras += [f"logprobs {params.logprobs}"] if params.logprobs is not None else []
    if params.greedy:
        return ", ".join(["greedy", *extras])
    parts = [f"temperature {params.temperature:g}"]
    parts += [f"top-k {params.top_k}"] if params.top_k > 0 else []
    parts += [f"top-p {params.top_p:g}"] if params.top_p < 1 else []
    parts += [f"min-p {params.min_p:g}"] if params.min_p > 0 else []
    parts += [f"seed {params.seed}"] if params.seed is not None else []
    return "sampled at " + ", ".join(parts + extras)


def paths_to_run(asked: list[str], engine: Engine) -> list[str]:
    """The asked paths, less `fast` when the target has none (said on stderr): an error if none is left."""
    if engine.fast is not None or "fast" not in asked:
        return asked
    reason, eager = engine.fast_unsupported, [p for p in asked if p != "fast"]
    if not eager:
        raise DDTreeError(f"no fast path for this target ({reason}); use --paths eager")
    log(f"fast path declined ({reason}): running the eager path only")
    return eager


def prefix_match(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each output that equals the reference before the first difference (1.0: identical).

    Greedy decoding is identical in exact arithmetic; in bf16, batching a tree changes rounding, and a
    near-tie in the target's logits can then flip one argmax, after which the continuations part.
    """
    shares = []
    for out, ref in zip(outputs, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
        shares.append(same / max(len(ref), 1))
    return sum(shares) / len(shares)


def table(report: dict) -> str:
    def floor(key: str) -> str:
        return ", ".join(f"{v:.2f} ms ({k})" for k, v in report[key].items())

    lines = [f"{report['model']} ({report['dtype']}) on {report['device']}, torch {report['torch']}: "
             f"{report['prompts']} prompts x "
             f"{report['prompt_tokens']} tokens, {report['max_new_tokens']} new, {report['sampling']}. "
             f"One target step moves {report['step_bytes'] / 1e9:.2f} GB: floor {floor('floor_ms')}. "
             f"A speculative round (the step, the draft's block pass and its commit) moves "
             f"{report['round_bytes'] / 1e9:.2f} GB: floor {floor('round_floor_ms')}; the draft's share of it, "
             f"{100 * report['draft_share_of_round_floor']:.0f}%, is the least non-verify share a round at the "
             f"floor has. round/floor: against the {report['round_vs_floor_at']} floor"
             + (f". The draft scores {report['draft_vocab']} tokens (--draft-vocab)" if report["draft_vocab"]
                and report["draft_vocab"] < report["vocab_size"] else "")
             + (f". The draft runs in {report['draft_quantization']} (--draft-quantization)"
                if report.get("draft_quantization") else "")
             + (f". The target runs in {report['quantization']} (--quantization)" if report.get("quantization")
                else ""),
             *([f"fast path {report['fast_path']}"] if report["fast_path"] != "available" else []),
             "", "| path | method | B | tau | TPOT ms | tok/s | round ms | round/floor | round/AR | verify/AR | "
             "draft | tree | verify | commit | host | non-verify | == ar |", "|" + "---|" * 17]
    for r in report["results"]:
        p = r["phase_ms"]
        path = r["path"] + ("" if r["path"] == "eager" or r["on_fast_path"] else " (declined: reference)")
        lines.append(f"| {path} | {r['method']} | {r['budget'] or '-'} | {r['tau']:.2f} | {r['tpot_ms']:.2f} | "
                     f"{r['tokens_per_second']:.1f} | {r['round_ms']:.2f} | {r['round_vs_floor']:.2f} | "
                     f"{_ratio(r['round_vs_ar_step'])} | "
                     f"{_ratio(r['verify_vs_ar_step'])} | "
                     + " | ".join(f"{p.get(k, 0.0):.2f}" for k in ("draft", "tree", "verify", "commit", "host"))
                     + f" | {100 * r['non_verify_share']:.0f}% | {_same(r)} |")
    if "fast_vs_eager_ar_prefix_match" in report:
        lines.append(f"\nfast ar vs eager ar: {100 * report['fast_vs_eager_ar_prefix_match']:.0f}% common prefix")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _same(r: dict) -> str:
    if r["lossless"] is None:
        return "-"
    return "yes" if r["lossless"] else f"{100 * r['prefix_match']:.0f}% prefix"
