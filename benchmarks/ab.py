"""A/B in one process: AR steps and tree rounds of a random-weight shape under two or more sides, alternated.

A side is LABEL or LABEL:SETTINGS, SETTINGS a comma-separated list of

    tree=PATH                         another checkout's server/ directory: its ddtree package, imported here under
                                      another name, so both run in this process on the same GPU (`git worktree add
                                      /tmp/base main~3`, then `--side base:tree=/tmp/base/server`)
    pdl=0|1, wgmma=0|1, compile=0|1   ddtree.switches for this checkout's code
    draft=fp8|none                    the drafter's format (--draft-quantization)

Every side builds its own engine over the shape's seeded weights (the same weights on every side); then the sides
take turns, `--passes` times: each times its AR step and one round at every --budget (ms a round, as `ddtree
bench` measures it) and compares its tokens with the first side's. Last, the median of each column, and its
ratio to the first side's.

    PYTHONPATH=server python benchmarks/ab.py --side new --side base:tree=/tmp/base/server
    PYTHONPATH=server python benchmarks/ab.py --side pdl --side no-pdl:pdl=0 --shape qwen3.6-27b --budgets 16 32
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from ddtree import switches

SWITCH_NAMES = ("pdl", "wgmma", "compile")


@dataclass
class Side:
    label: str
    tree: Path | None = None
    switches: dict[str, bool] = field(default_factory=dict)
    draft: str = "none"
    times: list[list[float]] = field(default_factory=list)  # per pass: AR ms, then each budget's round ms


def parse_side(text: str) -> Side:
    label, _, settings = text.partition(":")
    side = Side(label)
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        if key == "tree":
            side.tree = Path(value).resolve()
        elif key in SWITCH_NAMES and value in ("0", "1"):
            side.switches[key] = value == "1"
        elif key == "draft" and value in ("fp8", "none"):
            side.draft = value
        else:
            raise SystemExit(f"bad side setting {item!r} in {text!r}: tree=PATH, pdl|wgmma|compile=0|1, draft=fp8|none")
    if side.tree is not None and side.switches:
        raise SystemExit(f"{text}: switches apply to this checkout only (another tree reads its own environment)")
    return side


def aliased(tree: Path, label: str) -> str:
    """Copy `tree`/ddtree to a temporary directory as a package of another name, with its imports renamed, and put
    it on sys.path; returns the name."""
    name = "ddtree_" + re.sub(r"\W", "_", label)
    root = Path(tempfile.mkdtemp(prefix="ab-"))
    shutil.copytree(tree / "ddtree", root / name, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    for path in (root / name).rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom ddtree(?=[. ])", f"from {name}", text)
        text = re.sub(r"\bimport ddtree(?=[. \n])", f"import {name}", text)
        path.write_text(text)
    sys.path.insert(0, str(root))
    return name


def first_module(package: str, *candidates: str) -> ModuleType:
    """The first of package.candidate that imports (module paths moved between versions)."""
    for candidate in candidates:
        with contextlib.suppress(ModuleNotFoundError):
            return importlib.import_module(f"{package}.{candidate}")
    raise SystemExit(f"{package} has none of {', '.join(candidates)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", action="append", required=True, help="LABEL[:SETTINGS], at least two")
    ap.add_argument("--shape", default="qwen3-8b", help="a `ddtree bench --shape` name")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--draft-vocab", default=None, metavar="N", help="draft only the N lowest ids")
    ap.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (float32) for a smoke run")
    args = ap.parse_args()
    sides = [parse_side(s) for s in args.side]
    if len(sides) < 2:
        ap.error("name at least two sides")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engines = []
    for side in sides:
        package = aliased(side.tree, side.label) if side.tree else "ddtree"
        shapes = first_module(package, "bench.shapes", "fast.bench")
        runs = first_module(package, "bench.command", "fast.bench")
        sampling = first_module(package, "core.sampling", "sampling")
        with switches.override(**side.switches):
            fast, _ = shapes.build_shape(args.shape, device, dtype, fast_capacity=1024,
                                         draft_vocab=args.draft_vocab, draft_quantization=side.draft)
        params = sampling.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        engines.append((fast, runs.run, params))
        print(f"side {side.label}: {package} from {side.tree or 'this checkout'}, "
              f"switches {side.switches or 'as set'}, draft {side.draft}", file=sys.stderr, flush=True)
    vocab = engines[0][0].target.shape.vocab_size
    seeded = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 2, (args.prompt_tokens,), generator=seeded).tolist()]
    columns = ["AR step ms", *(f"B = {b} round ms" for b in args.budgets)]
    print(f"{args.shape}, prompt {args.prompt_tokens} tokens, {args.max_new_tokens} new, draft vocabulary "
          f"{args.draft_vocab or 'whole'}\n")
    print(f"| pass | side | {' | '.join(columns)} | tokens |\n|{'---|' * (3 + len(columns))}")
    reference: list[list[list[int]]] | None = None
    for number in range(1, args.passes + 1):
        for side, (engine, run, params) in zip(sides, engines, strict=True):
            with switches.override(**side.switches):
                results = [run(engine, prompts, "ar", 1, params)]
                results += [run(engine, prompts, "ddtree", b, params) for b in args.budgets]
            side.times.append([r["round_ms"] for r in results])
            outputs = [r["outputs"] for r in results]
            reference = reference or outputs
            same = "same" if outputs == reference else "differ"
            times = " | ".join(f"{t:.3f}" for t in side.times[-1])
            print(f"| {number} | {side.label} | {times} | {same} |", flush=True)
    print(f"\nmedians over {args.passes} passes (ratio to {sides[0].label})\n\n| side | {' | '.join(columns)} |\n"
          f"|{'---|' * (1 + len(columns))}")
    base = [statistics.median(col) for col in zip(*sides[0].times, strict=True)]
    for side in sides:
        medians = [statistics.median(col) for col in zip(*side.times, strict=True)]
        cells = [f"{m:.3f} ({m / b:.3f})" for m, b in zip(medians, base, strict=True)]
        print(f"| {side.label} | {' | '.join(cells)} |")
    print(f"\n{sides[0].label}: rounds in AR steps: " + ", ".join(
        f"B = {b} {m / base[0]:.3f}" for b, m in zip(args.budgets, base[1:], strict=True)))


if __name__ == "__main__":
    main()
