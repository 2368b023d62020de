"""The benchmark suite, `ddtree bench` (ddtree/bench/command.py): ar, dflash and ddtree, fast and eager paths.

    PYTHONPATH=server python benchmarks/bench.py --shape qwen3-8b --prompts 1 --prompt-tokens 512 --json 8b.json
    PYTHONPATH=server python benchmarks/bench.py --prompts 4 --json demo.json    # the embedded demo pair
"""

import sys

from ddtree.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
