"""What a grammar costs on the fast path: each method with and without a JSON-schema constraint, in one process.

Demo pair by default (greedy; the prompts are held-out stdlib files, so under the schema the model writes
JSON it was never trained on and τ falls: the table shows by how much). A constrained round adds one host
synchronisation (the tree's tokens are read back) and the grammar masks for every node, computed on the
host and copied in; both fall inside the `verify` phase, which the table reports next to the round.

    PYTHONPATH=server python benchmarks/constrained.py [--target DIR --draft DIR] [--budgets 16 32]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from dataclasses import replace

from ddtree.bench.command import run
from ddtree.bench.shapes import build_pair
from ddtree.core.grammar import json_schema_grammar
from ddtree.core.sampling import SamplingParams
from ddtree.training.corpus import find_files, read_texts, split_files

# Bounded, so that every reply can finish within --max-new-tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "lines"], "properties": {
    "name": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 24}},
    "lines": {"type": "integer", "minimum": 0, "maximum": 99999}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[32])
    args = parser.parse_args()
    fast, _ = build_pair(args.target, args.draft, args.device, None, fast_capacity=1024)
    _, held = split_files(find_files([sysconfig.get_paths()["stdlib"]], ["*.py"]))
    texts = [t for t in read_texts(held) if len(t) > 4 * args.prompt_tokens][:args.prompts]
    prompts = [fast.encode(t)[:args.prompt_tokens] for t in texts]
    free = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    constrained = replace(free, grammar=json_schema_grammar(SCHEMA), ignore_eos=False)
    print("| method | B | grammar | tok/s | τ | round ms | verify ms | replies that parse |")
    print("|---|---|---|---|---|---|---|---|")
    runs = [("ar", 1), ("dflash", 1)] + [("ddtree", b) for b in args.budgets]
    for method, budget in runs:
        for label, params in (("none", free), ("json schema", constrained)):
            r = run(fast, prompts, method, budget, params)
            parses = "-"
            if params.grammar is not None:
                parses = f"{sum(_parses(fast.decode(ids)) for ids in r['outputs'])} of {len(r['outputs'])}"
            print(f"| {method} | {budget if method == 'ddtree' else '-'} | {label} | {r['tokens_per_second']:.0f} | "
                  f"{r['tau']:.2f} | {r['round_ms']:.3f} | {r['phase_ms'].get('verify', 0):.3f} | {parses} |",
                  flush=True)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
