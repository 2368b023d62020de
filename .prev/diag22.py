"""Qwen3-Next float32 on CUDA: who parts from whom (CPU reference, GPU reference, fast path)."""
import sys, tempfile
from pathlib import Path
import torch
sys.path[:0] = ["tests", "benchmarks", "server"]
from ddtree.engine import Engine
from ddtree.sampling import SamplingParams
from ddtree.fast import attention
from tiny import make_draft, make_hybrid_target
import ab_steps

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
print("tf32 matmul", torch.backends.cuda.matmul.allow_tf32, "cudnn", torch.backends.cudnn.allow_tf32,
      torch.get_float32_matmul_precision(), flush=True)
tmp = Path(tempfile.mkdtemp())
make_draft(tmp / "draft", taps=[1, 2])
arch = sys.argv[1] if len(sys.argv) > 1 else "qwen3_next"
make_hybrid_target(tmp / "hybrid", arch, seed=0)
cpu = Engine.from_pretrained(tmp / "hybrid", tmp / "draft", device="cpu", dtype="float32", fast=False)
fast = Engine.from_pretrained(tmp / "hybrid", tmp / "draft", device="cuda", dtype="float32",
                              fast="refonly" not in sys.argv, fast_capacity=512)
ref = Engine(fast.target, fast.draft, fast.tokenizer)
prompts = [[1, 2, 3, 4, 5], list(range(10, 80)) * 5]


def logits(engine, ids):
    t = torch.tensor(ids, device=engine.target.device)
    return engine.target.forward(t, torch.arange(len(t), device=t.device), engine.target.new_cache())[0].float().cpu()


def first(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


for prompt in prompts:
    want = cpu.generate(prompt, GREEDY, method="ar").token_ids
    gref = ref.generate(prompt, GREEDY, method="ar").token_ids
    lc, lg = logits(cpu, prompt + want), logits(ref, prompt + want)
    d = (lc - lg).abs().amax(-1)
    print(f"prompt len {len(prompt)}: gpu-ref ar parts from cpu ar at {first(want, gref)}; "
          f"teacher-forced |cpu-gpu ref| max {d.max():.2e} prompt-part {d[:len(prompt)].max():.2e} "
          f"gen-part {d[len(prompt):].max():.2e}", flush=True)
    top2 = lc[len(prompt) - 1:-1].topk(2, -1).values
    print("  cpu ref smallest top-2 gap over the decode", (top2[:, 0] - top2[:, 1]).min().item(), flush=True)
    for variant in (() if "refonly" in sys.argv else ("now", "v13")):
        attention.launch_config = ab_steps.ATTENTION[variant]
        fast.fast._plans.clear()
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 5), ("ddtree", 64)):
            gen = fast.stream(prompt, GREEDY, method=method, budget=budget)
            list(gen)
            i = first(want, gen.token_ids)
            msg = "same" if i is None else f"parts at {i}: want {want[i]} got {gen.token_ids[i]}"
            if i is not None:
                l = lc[len(prompt) + i - 1]
                msg += f" cpu margin {(l[want[i]] - l[gen.token_ids[i]]).item():.4f}"
            print(f"  {variant} {method} {budget}: {msg}", flush=True)
