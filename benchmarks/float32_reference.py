"""In float32 on a GPU: does the fast path give the CPU reference's greedy tokens, and how far does the GPU's
own eager forward stray from the CPU's?

Builds the GPU tests' tiny checkpoints (tests/tiny.py: a hybrid target of the given architecture and a DFlash
draft, random weights), decodes the tests' two prompts greedily (40 tokens; the second prompt takes two
chunks) with the CPU reference's `ar`, the GPU eager path's `ar`, and the fast path's `ar`, `dflash` and
`ddtree` at budgets 5 and 64. It prints where
each parts from the CPU's tokens, the CPU's logit margin there, and the largest logit difference between the
GPU's and the CPU's eager forward over the CPU's decode (teacher-forced). On CUDA, transformers' Gated
DeltaNet layers run fla's Triton kernels, whose float32 dots default to TF32.

    PYTHONPATH=server:tests python benchmarks/float32_reference.py --arch qwen3_next
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from tiny import make_draft, make_hybrid_target

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 80)) * 5]
METHODS = (("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64))


def teacher_forced_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids, device=engine.target.device)
    return engine.target.forward(t, torch.arange(len(t), device=t.device), engine.target.new_cache())[0].float().cpu()


def parting(want: list[int], got: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_next", choices=["qwen3_5", "qwen3_next"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    make_draft(tmp / "draft", taps=[1, 2])
    make_hybrid_target(tmp / "target", args.arch, seed=0)
    cpu = Engine.from_pretrained(tmp / "target", tmp / "draft", device="cpu", dtype="float32")
    fast = Engine.from_pretrained(tmp / "target", tmp / "draft", device="cuda", dtype="float32", fast=True,
                                  fast_capacity=512)
    gpu_eager = Engine(fast.target, fast.draft, fast.tokenizer)
    for prompt in PROMPTS:
        want = cpu.generate(prompt, GREEDY, method="ar").token_ids
        eager = gpu_eager.generate(prompt, GREEDY, method="ar").token_ids
        on_cpu = teacher_forced_logits(cpu, prompt + want)
        drift = (on_cpu - teacher_forced_logits(gpu_eager, prompt + want)).abs().amax(-1)
        top2 = on_cpu[len(prompt) - 1:-1].topk(2, -1).values
        print(f"prompt of {len(prompt)} tokens: GPU eager `ar` parts from the CPU's at {parting(want, eager)}; "
              f"largest |GPU eager - CPU| logit {drift.max():.3g} (prompt rows {drift[:len(prompt)].max():.3g}); "
              f"the CPU's smallest top-2 gap over its decode {(top2[:, 0] - top2[:, 1]).min():.4f}", flush=True)
        for method, budget in METHODS:
            got = fast.generate(prompt, GREEDY, method=method, budget=budget).token_ids
            i = parting(want, got)
            if i is None:
                where = "the CPU's tokens"
            else:
                row = on_cpu[len(prompt) + i - 1]
                where = f"parts at {i} (the CPU's margin there {row[want[i]] - row[got[i]]:.4f})"
            print(f"  fast {method} {budget or ''}: {where}", flush=True)


if __name__ == "__main__":
    main()
