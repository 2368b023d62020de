"""The drafter's format A/B, in one process: rounds of a random-weight shape with its draft in the model's dtype
and in fp8 (`--draft-quantization fp8`, ddtree.quantize), over one target.

Two fast engines share the target; the fp8 one drafts with a quantized copy of the same draft weights. Passes
alternate between them, timing the AR step (a control: the draft does not
run), dflash and ddtree rounds, and their draft and commit steps. Graphs are captured in the first pass.

    PYTHONPATH=server python benchmarks/ab_draft.py [--shape qwen3-8b] [--draft-vocab 16384] [--budgets 16 64]
"""

from __future__ import annotations

import argparse
import copy

import torch
from ddtree.bench.command import SHAPES, build_draft, build_target, draft_vocab_ids, run
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "qwen3.6-27b", "qwen3-30b-a3b"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--draft-vocab", default=None, metavar="N", help="draft only the N lowest ids")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2, help="times over the two formats")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    target = build_target(SHAPES[args.shape], device, torch.bfloat16)
    draft = build_draft(SHAPES[args.shape], target, device, torch.bfloat16)
    hot = draft_vocab_ids(args.draft_vocab, target.shape.vocab_size)
    engines = {"bf16": Engine(target, draft, fast=True, fast_capacity=1024, draft_vocab=hot),
               "fp8": Engine(target, copy.deepcopy(draft), fast=True, fast_capacity=1024, draft_vocab=hot,
                             draft_quantization="fp8")}
    prompts = [torch.randint(0, target.shape.vocab_size - 2, (512,), generator=torch.Generator().manual_seed(0))
               .tolist()]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    runs = [("ar", 1), ("dflash", 1)] + [("ddtree", b) for b in args.budgets]
    names = ["AR step", "dflash", *(f"B = {b}" for b in args.budgets)]
    print(f"{args.shape}, draft vocabulary {args.draft_vocab or 'whole'}: round ms (draft ms, commit ms, "
          "non-verify share)\n")
    print("| draft | " + " | ".join(names) + " |\n|" + "---|" * (1 + len(names)))
    for _ in range(args.passes):
        for label, engine in engines.items():
            cells = []
            for method, budget in runs:
                r = run(engine, prompts, method, budget, params)
                phase = r["phase_ms"]
                cells.append(f"{r['round_ms']:.3f}" + ("" if method == "ar" else
                                                        f" ({phase['draft']:.3f}, {phase['commit']:.3f}, "
                                                        f"{100 * r['non_verify_share']:.1f} %)"))
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
