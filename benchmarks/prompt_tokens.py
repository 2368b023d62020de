"""The front end's tokenization prefix cache (server/ddtree/api/prompt_tokens.py) on a ~9 KB prompt of real words
(this repository's README) with the demo tokenizer: plain `tokenizer.encode`, the cache's first sight of the
prompt (every piece encoded), and the same prefix with another question after it (its pieces from the cache).
Each repetition ends the prompt with a different question, so the tail is always new; medians in milliseconds.

    PYTHONPATH=server python benchmarks/prompt_tokens.py --reps 50
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ddtree.api.prompt_tokens import PromptTokens
from ddtree.engine.engine import ASSETS
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]


def median_ms(reps: int, run: Callable[[int], object]) -> float:
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        run(rep)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--chars", type=int, default=8600, help="the shared prefix's length (default 8600)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "target")
    prefix = (ROOT / "README.md").read_text()[:args.chars]
    prompts = [f"{prefix}\n\nQuestion {rep}: what does the server do with request number {rep}?"
               for rep in range(args.reps)]
    warm = PromptTokens(tokenizer)
    for prompt in prompts:  # equal ids, and the prefix in the cache for the timed hits
        assert warm.encode(prompt) == tokenizer.encode(prompt, add_special_tokens=False)
    fresh = [PromptTokens(tokenizer) for _ in prompts]  # made before the timing: the cost is encoding
    hits = PromptTokens(tokenizer)
    hits.encode(prefix + "\n\nA first question?")
    rows = {
        "tokenizer.encode": median_ms(args.reps, lambda r: tokenizer.encode(prompts[r], add_special_tokens=False)),
        "cache, first time": median_ms(args.reps, lambda r: fresh[r].encode(prompts[r])),
        "cache, prefix cached": median_ms(args.reps, lambda r: hits.encode(prompts[r])),
    }
    cached = hits.cuts(prompts[0])[-1]
    print(f"prompt {len(prompts[0])} chars, {len(tokenizer.encode(prompts[0]))} tokens; "
          f"{len(hits.cuts(prompts[0]))} pieces, {cached} chars cached, {len(prompts[0]) - cached} encoded fresh")
    for name, ms in rows.items():
        print(f"{name:22s} {ms:7.3f} ms (median of {args.reps})")


if __name__ == "__main__":
    main()
