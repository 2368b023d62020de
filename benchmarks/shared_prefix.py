"""Write a shared-prefix JSONL dataset for `ddtree bench-serve --dataset FILE` (or any client that reads
{"prompt": ..., "max_tokens": ...} lines): one common prefix (a system prompt) before every prompt's own turn,
the traffic prefix caching is for. `ddtree bench-serve --dataset shared-prefix` generates the same prompts itself.

    PYTHONPATH=server python benchmarks/shared_prefix.py --out shared.jsonl --prompts 200 --prefix-len 1500 \\
        --input-len 50 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddtree.bench.serve_load import shared_prefix_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--prefix-len", type=int, default=1500, help="words of the common prefix (about as many tokens)")
    p.add_argument("--input-len", type=int, default=50, help="words of each prompt's own turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    prompts = shared_prefix_prompts(args.prompts, args.prefix_len, args.input_len, args.seed)
    args.out.write_text("".join(json.dumps({"prompt": q.prompt, "max_tokens": args.max_tokens}) + "\n"
                                for q in prompts))


if __name__ == "__main__":
    main()
