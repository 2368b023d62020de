"""τ and CPU decode speed of `ar`, `dflash` and `ddtree` on held-out files, in one process, same prompts.

Prompts are the first --prompt-tokens tokens of held-out files (`ddtree.training.corpus.is_held_out`: files
the demo pair never trained on) of this interpreter's standard library. Every method decodes every prompt
greedily; outputs are checked against `ar` (lossless), and methods run back to back per prompt so machine
load hits all of them alike. τ = tokens committed per target forward (bonus included), pooled over prompts.

    python benchmarks/demo_pair.py                       # the embedded demo pair, CPU
    python benchmarks/demo_pair.py --target T --draft D  # any pair
"""

from __future__ import annotations

import argparse
import platform
import sys
import sysconfig

import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.training.corpus import find_files, read_texts, split_files


def held_out_prompts(engine: Engine, corpus: str, files: int, prompt_tokens: int) -> list[list[int]]:
    _, held = split_files(find_files([corpus], ["*.py"]))
    texts = [t for t in read_texts(held) if len(t) > 4 * prompt_tokens][:files]
    return [engine.encode(t)[:prompt_tokens] for t in texts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="default: the embedded demo pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="held-out files are taken from here")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.target, args.draft, device=args.device)
    prompts = held_out_prompts(engine, args.corpus, args.files, args.prompt_tokens)
    runs = [("ar", 0), ("dflash", 0)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for method, budget in runs:  # warm-up
        engine.generate(prompts[0][:32], SamplingParams(max_new_tokens=16), method=method, budget=budget or None)
    totals = {run: {"committed": 0, "rounds": 0, "decoded": 0, "seconds": 0.0, "lossless": True} for run in runs}
    for i, ids in enumerate(prompts):
        reference = None
        for run in runs:
            method, budget = run
            s = engine.generate(ids, params, method=method, budget=budget or None)
            reference = s.token_ids if reference is None else reference
            t = totals[run]
            t["lossless"] &= s.token_ids == reference
            t["committed"] += s.stats.committed_tokens
            t["rounds"] += s.stats.rounds
            t["decoded"] += max(s.stats.generated_tokens - 1, 0)
            t["seconds"] += s.stats.decode_seconds
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    print(f"{len(prompts)} held-out files of {args.corpus}, {args.prompt_tokens}-token prompts, "
          f"{args.max_new_tokens} new tokens, greedy, {args.device} ({torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}), torch {torch.__version__}\n")
    print("| method | budget | tau | decode tok/s | speed-up vs ar | output == ar |")
    print("|---|---|---|---|---|---|")
    ar_speed = totals[("ar", 0)]["decoded"] / totals[("ar", 0)]["seconds"]
    for (method, budget), t in totals.items():
        speed = t["decoded"] / t["seconds"]
        print(f"| {method} | {budget or '-'} | {t['committed'] / t['rounds']:.2f} | {speed:.1f} | "
              f"{speed / ar_speed:.2f}x | {'yes' if t['lossless'] else 'NO'} |")
    return 0 if all(t["lossless"] for t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
