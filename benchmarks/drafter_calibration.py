"""Is the drafter's tree probability a calibrated forecast of what the target accepts? Decodes code prompts (pieces of
core/prefix_cache.py) on the batched path at fixed budgets and prints, per round and request, the sum of the
verified nodes' prefix probabilities (the batch budget's expected accepted tokens, core/budget.py) against the
draft tokens the target accepted.

    PYTHONPATH=server python benchmarks/drafter_calibration.py [--budgets 32 8] [--device cpu]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.batch import BatchOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 8])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    engine = Engine.from_pretrained(device=args.device)
    batch = engine.batch(BatchOptions(max_num_seqs=args.requests, kv_cache_tokens=16 * 1024,
                                      single_request_path=False, batch_budget=False))
    backend = batch.backends[0]
    rounds: list[tuple[float, int]] = []
    observe = backend.calibration.observe

    def record(scores: np.ndarray, accepted: np.ndarray) -> None:  # one call a round, every request's nodes
        rounds.append((float(np.exp(scores).sum()), int(accepted.sum())))
        observe(scores, accepted)

    backend.calibration.observe = record
    source = (Path(__file__).parents[1] / "server/ddtree/core/prefix_cache.py").read_text()
    piece = len(source) // args.requests
    prompts = [engine.tokenizer(source[i * piece:(i + 1) * piece])["input_ids"][:200] for i in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for budget in args.budgets:
        rounds.clear()
        for prompt in prompts:
            batch.add(prompt, params, method="ddtree", budget=budget)
        while batch.has_work():
            batch.step()
        forecast, accepted = (sum(r[i] for r in rounds) for i in (0, 1))
        print(f"budget {budget}: {len(rounds)} rounds of {args.requests} requests; forecast {forecast:.0f} accepted "
              f"draft tokens, accepted {accepted} ({accepted / forecast:.2f}x the forecast)")


if __name__ == "__main__":
    main()
