"""Where a lone request's time goes in process: add -> first token -> last token through the batch engine as the
server's engine runs it (the single-request path), without and with a cached prompt prefix, then the single path's
prefill alone at the two prompt lengths.

    PYTHONPATH=server python benchmarks/lone_request.py [--device cuda]
    PYTHONPATH=server python benchmarks/lone_request.py --shape qwen3-8b --method ar --prefix 1650 --new 55
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch
from ddtree.bench.timing import sync
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.batch import BatchOptions, warm_up
from ddtree.engine.sequence import Status


def ms(values: list[float]) -> float:
    """Median in milliseconds, the first (a warm-up) left out."""
    return round(1e3 * statistics.median(values[1:]), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--shape", help="a random-weight shape (models/shapes.py) instead of the demo pair")
    p.add_argument("--method", choices=["ddtree", "dflash", "ar"], default="ddtree")
    p.add_argument("--prefix", type=int, default=700, help="tokens of the prefix the second series shares")
    p.add_argument("--new", type=int, default=130, help="tokens of each prompt's own")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    load = (functools.partial(Engine.from_shape, args.shape) if args.shape else Engine.from_pretrained)
    engine = load(device=args.device, fast=True, method=args.method)
    device = engine.target.device
    batch = engine.batch(BatchOptions(kv_cache_tokens=200_000))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    warm_up(batch, SamplingParams())
    rng = random.Random(0)
    for shared in (0, args.prefix):
        prefix = [rng.randrange(3, engine.vocab_size) for _ in range(shared)]
        firsts, totals, cached = [], [], 0
        for _ in range(args.trials):
            prompt = prefix + [rng.randrange(3, engine.vocab_size) for _ in range(args.new)]
            sync(device)
            started, first = time.perf_counter(), None
            seq = batch.add(prompt, params)
            while seq.status is not Status.FINISHED:
                batch.step()
                if first is None and seq.generation.token_ids:
                    first = time.perf_counter() - started
            totals.append(time.perf_counter() - started)
            firsts.append(first)
            cached = seq.cached_prompt
        print(f"{shared + args.new}-token prompts ({cached} cached, on {type(seq.backend).__name__}): first token "
              f"{ms(firsts)} ms, {args.max_new_tokens} tokens {ms(totals)} ms (medians of {args.trials - 1})")
    for n in (args.new, args.prefix + args.new):
        ids = torch.randint(3, engine.vocab_size, (n,), device=device)
        times = []
        for _ in range(6):
            sync(device)
            started = time.perf_counter()
            engine.fast.prefill(ids, with_draft=True)
            sync(device)
            times.append(time.perf_counter() - started)
        print(f"the single path's prefill of {n} tokens: {ms(times)} ms")


if __name__ == "__main__":
    main()
