"""τ and tok/s of DFlash and DFlash2 drafters for one target, as chains and as trees, in one process.

For each drafter given (any mix of DFlash and DFlash2 checkpoints trained for the same target), on held-out
files: `dflash` (a DFlash drafter's argmax chain; a DFlash2 drafter's selector chain) and `ddtree` at each budget
(DDTree over the per-position marginals; over a DFlash2 drafter's selector transitions), plus `ar`, greedy and at
each sampling temperature. All engines share one target and run on the fast path (CUDA graphs) when the device is
a GPU; every method decodes every prompt back to back, so machine load hits all alike. Greedy outputs are checked
against `ar` (lossless); sampled runs use seed + prompt index for every method. τ = tokens committed per target
forward, bonus included, pooled over prompts; tok/s = decoded tokens over decode time, pooled.

    python benchmarks/drafters.py --target T --draft dflash=D1 --draft dflash2=D2 --device cuda
    python benchmarks/drafters.py --draft dflash2=D2     # the embedded demo target with its DFlash drafter and D2

The summary checks issue 43's targets: DFlash2 chain τ above DFlash chain τ; DDTree over the selector at least
the τ of DDTree over marginals at each budget; the DFlash2 tree's best tok/s above the DFlash2 chain's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
from dataclasses import dataclass

import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.engine import ASSETS
from ddtree.models.draft import load_draft
from ddtree.training.corpus import find_files, read_texts, split_files


@dataclass
class Pooled:
    committed: int = 0
    rounds: int = 0
    decoded: int = 0
    seconds: float = 0.0
    lossless: bool = True

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def speed(self) -> float:
        return self.decoded / self.seconds if self.seconds else 0.0


def held_out_prompts(engine: Engine, corpus: str, files: int, prompt_tokens: int) -> list[list[int]]:
    """Beginnings of files the demo pair never trained on (ddtree.training.corpus.is_held_out)."""
    _, held = split_files(find_files([corpus], ["*.py"]))
    texts = [t for t in read_texts(held) if len(t) > 4 * prompt_tokens][:files]
    return [engine.encode(t)[:prompt_tokens] for t in texts]


def engines(target: str | None, drafts: list[tuple[str, str]], device: str, dtype: str | None,
            capacity: int) -> dict[str, Engine]:
    """name -> engine, every one over the same loaded target (a fast path each, on CUDA)."""
    first_name, first_path = drafts[0]
    first = Engine.from_pretrained(target, first_path, device=device, dtype=dtype, fast=None, fast_capacity=capacity)
    out = {first_name: first}
    for name, path in drafts[1:]:
        draft = load_draft(path, first.target.shape, device=first.target.device, dtype=first.target.dtype)
        out[name] = Engine(first.target, draft, first.tokenizer, fast=first.fast is not None, fast_capacity=capacity)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="default: the embedded demo target")
    ap.add_argument("--draft", action="append", default=[], metavar="NAME=DIR",
                    help="a drafter to compare (repeat); the demo target's own DFlash drafter is added as 'dflash' "
                    "when --target is not given")
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="held-out files are taken from here")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--temperatures", default="0,0.8", help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    ap.add_argument("--fast-capacity", type=int, default=4096)
    ap.add_argument("--json", help="also write the pooled results here")
    args = ap.parse_args()
    drafts = [tuple(spec.split("=", 1)) for spec in args.draft]
    if args.target is None and not any(name == "dflash" for name, _ in drafts):
        drafts.insert(0, ("dflash", str(ASSETS / "draft")))
    if not drafts or any(len(d) != 2 for d in drafts):
        ap.error("give drafters as --draft NAME=DIR")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    by_name = engines(args.target, drafts, device, args.dtype, args.fast_capacity)
    first = next(iter(by_name.values()))
    prompts = held_out_prompts(first, args.corpus, args.files, args.prompt_tokens)
    budgets = [int(b) for b in args.budgets.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    runs = [(name, "dflash", 0) for name in by_name] + [(name, "ddtree", b) for name in by_name for b in budgets]
    runs.insert(0, (drafts[0][0], "ar", 0))
    for name, method, budget in runs:  # warm-up: graph captures and kernel builds, greedy and sampled
        for temperature in temperatures:
            params = SamplingParams(max_new_tokens=32, temperature=temperature, seed=0, ignore_eos=True)
            by_name[name].generate(prompts[0][:64], params, method=method, budget=budget or None)
    pooled = {(run, t): Pooled() for run in runs for t in temperatures}
    on_fast = set()
    for i, ids in enumerate(prompts):
        for temperature in temperatures:
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed + i,
                                    ignore_eos=True)
            want = None
            for run in runs:
                name, method, budget = run
                engine = by_name[name]
                engine.target.set_taps(engine.draft.config.target_layer_ids)  # the reference path's hooks, if used
                gen = engine.stream(ids, params, method=method, budget=budget or None)
                for _ in gen:
                    pass
                if gen.backend.name == "fast":
                    on_fast.add(run)
                s, p = gen.stats, pooled[run, temperature]
                want = gen.token_ids if want is None else want
                p.lossless &= temperature > 0 or gen.token_ids == want
                p.committed += s.committed_tokens
                p.rounds += s.rounds
                p.decoded += max(s.generated_tokens - 1, 0)
                p.seconds += s.decode_seconds
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    kinds = {name: engine.draft.config.architecture for name, engine in by_name.items()}
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    print(f"{len(prompts)} held-out files of {args.corpus}, {args.prompt_tokens}-token prompts, "
          f"{args.max_new_tokens} new tokens, {device} ({gpu}), torch {torch.__version__}; "
          + ", ".join(f"{name} = {kind}" for name, kind in kinds.items()) + "\n")
    print("| drafter | method | budget | temperature | tau | decode tok/s | vs ar | path | output == ar |")
    print("|---|---|---|---|---|---|---|---|---|")
    for temperature in temperatures:
        ar = pooled[runs[0], temperature].speed
        for run in runs:
            name, method, budget = run
            p = pooled[run, temperature]
            drafter = "-" if method == "ar" else f"{name} ({kinds[name]})"
            same = "(sampled)" if temperature > 0 else "yes" if p.lossless else "NO"
            print(f"| {drafter} | {method} | {budget or '-'} | {temperature:g} | {p.tau:.2f} | {p.speed:.1f} | "
                  f"{p.speed / ar:.2f}x | {'fast' if run in on_fast else 'reference'} | {same} |")
    print()
    for line in targets(pooled, kinds, budgets, temperatures):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"drafter": n, "kind": kinds[n], "method": m, "budget": b, "temperature": t, "tau": p.tau,
                        "tokens_per_second": p.speed, "lossless": p.lossless, "fast": (n, m, b) in on_fast}
                       for ((n, m, b), t), p in pooled.items()], f, indent=2)
    return 0 if all(p.lossless for p in pooled.values()) else 1


def targets(pooled: dict, kinds: dict[str, str], budgets: list[int], temperatures: list[float]) -> list[str]:
    """Issue 43's comparisons, for the first DFlash and the first DFlash2 drafter given."""
    dflash = next((n for n, k in kinds.items() if k == "DFlashDraftModel"), None)
    dflash2 = next((n for n, k in kinds.items() if k == "DFlash2DraftModel"), None)
    if dflash2 is None:
        return ["(no DFlash2 drafter given: nothing to compare)"]
    lines = []
    for t in temperatures:
        chain2 = pooled[(dflash2, "dflash", 0), t]
        trees2 = {b: pooled[(dflash2, "ddtree", b), t] for b in budgets}
        best = max(budgets, key=lambda b: trees2[b].speed)
        if dflash is not None:
            chain = pooled[(dflash, "dflash", 0), t]
            lines.append(f"T={t:g}: DFlash2 chain tau {chain2.tau:.2f} vs DFlash chain {chain.tau:.2f}: "
                         f"{'above' if chain2.tau > chain.tau else 'NOT above'}")
            for b in budgets:
                marginal = pooled[(dflash, "ddtree", b), t]
                lines.append(f"T={t:g}: B={b}: tree over the selector tau {trees2[b].tau:.2f} vs over marginals "
                             f"{marginal.tau:.2f}: {'at least as high' if trees2[b].tau >= marginal.tau else 'LOWER'}")
        lines.append(f"T={t:g}: DFlash2 tree at its best budget ({best}) {trees2[best].speed:.1f} tok/s vs DFlash2 "
                     f"chain {chain2.speed:.1f}: {'faster' if trees2[best].speed > chain2.speed else 'NOT faster'}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
