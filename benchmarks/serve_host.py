"""The server's host ceiling: `ddtree serve`'s API, scheduler and streaming around an engine whose step costs a
fixed time, so what the server adds to every step shows on a CPU.

The stand-in engine waits --step-ms a step with the GIL released (as the real worker does while the device
runs) and gives every running request --tokens-per-round tokens (1: ar; ~5: a ddtree round). Everything else is
the real server: the demo tokenizer, prompt rendering, the worker thread's detokenization and stop strings,
Prometheus metrics, SSE chunks. bench-serve (a separate process) then reports served tok/s, against the ideal
of concurrency x tokens-per-round / step time.

    PYTHONPATH=server python benchmarks/serve_host.py --step-ms 4 --tokens-per-round 1 --concurrency 1 8 32 64
    PYTHONPATH=server python benchmarks/serve_host.py --step-ms 8 --tokens-per-round 5 --concurrency 1 8 32 64
    ... --prefix-len 1500 --max-tokens 32    # 9 KB prompts that share a prefix (the prefix-caching load)
    ... --no-engine-process    # the engine stepping in a thread of the server's process
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class PacedSequence:
    def __init__(self, prompt_ids: list[int], max_tokens: int) -> None:
        self.prompt_ids, self.left, self.started = prompt_ids, max_tokens, False
        self.cached_prompt = 0


class PacedBatch:
    """The batch engine's interface: each step sleeps the step time, then every live request gets its tokens."""

    backends, blocks, waiting = (), None, 0

    def __init__(self, max_num_seqs: int, step_s: float, tokens: int, vocab: int) -> None:
        from ddtree.engine.batch import StepStats

        self.max_num_seqs, self.step_s, self.tokens, self.vocab = max_num_seqs, step_s, tokens, vocab
        self.live: list[PacedSequence] = []
        self.last = StepStats()
        self._stats = StepStats

    @property
    def kv_usage(self) -> float:
        return len(self.live) / self.max_num_seqs

    def add(self, prompt_ids, params, cache_salt=None) -> PacedSequence:
        seq = PacedSequence(list(prompt_ids), params.max_new_tokens)
        self.live.append(seq)
        return seq

    def abort(self, seq: PacedSequence) -> None:
        if seq in self.live:
            self.live.remove(seq)

    def step(self) -> list:
        from ddtree.engine.generation import RoundOutput

        started = time.perf_counter()
        time.sleep(self.step_s)
        out = []
        for seq in list(self.live):
            if not seq.started:
                seq.started = True
                seq.left -= 1
                result = RoundOutput([1000 + len(seq.prompt_ids) % 7], None, 0, 0, {}, is_prefill=True)
            else:
                n = min(self.tokens, seq.left)
                seq.left -= n
                ids = [(1000 + 37 * (seq.left + i)) % self.vocab for i in range(n)]
                result = RoundOutput(ids, None, self.tokens - 1, n - 1, {}, "length" if seq.left <= 0 else None)
            if result.finish_reason is not None or seq.left <= 0:
                if result.finish_reason is None:
                    result.finish_reason = "length"
                self.abort(seq)
            out.append((seq, result))
        self.last = self._stats(sequences=len(out), verified_tokens=len(out) * self.tokens,
                                seconds=time.perf_counter() - started)
        return out


class PacedEngine:
    """The demo engine for everything the server asks of it (tokenizer, template, limits), with a paced batch."""

    def __init__(self, step_s: float, tokens: int) -> None:
        from ddtree.engine import Engine

        self._engine = Engine.from_pretrained(None, None, device="cpu", fast=False)
        self.step_s, self.tokens = step_s, tokens
        self.fast = None

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def batch(self, options) -> PacedBatch:
        return PacedBatch(options.max_num_seqs, self.step_s, self.tokens, self._engine.vocab_size)


def serve(port: int, step_s: float, tokens: int, max_num_seqs: int, engine_process: bool) -> None:
    import functools

    import uvicorn
    from ddtree.api.app import create_app
    from ddtree.api.config import ServerConfig
    from ddtree.api.serve import SWITCH_INTERVAL_S
    from ddtree.engine.batch import BatchOptions

    config = ServerConfig(batch=BatchOptions(max_num_seqs=max_num_seqs), engine_process=engine_process)
    app = create_app(functools.partial(PacedEngine, step_s, tokens), config)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--tokens-per-round", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="words of a prefix every prompt shares (bench-serve --dataset shared-prefix); 0: random")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the stand-in engine in a process of its own, as `ddtree serve` runs it")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.step_ms / 1e3, args.tokens_per_round, max(args.concurrency), args.engine_process)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT / "server")}
    server = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]], env=env)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{args.port}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the paced server did not come up")
            time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "serve.json"
            subprocess.run([sys.executable, "-m", "ddtree.cli", "bench-serve", "--base-url",
                            f"http://127.0.0.1:{args.port}", "--num-prompts", str(args.num_prompts), "--ignore-eos",
                            "--max-tokens", str(args.max_tokens), "--concurrency", *map(str, args.concurrency),
                            *(["--dataset", "shared-prefix", "--prefix-len", str(args.prefix_len), "--input-len", "50"]
                              if args.prefix_len else []),
                            "--json", str(report)], env=env, check=True, stdout=subprocess.DEVNULL)
            runs = json.loads(report.read_text())["runs"]
    finally:
        server.terminate()
        server.wait()
    where = "its own process" if args.engine_process else "the server's process"
    print(f"step {args.step_ms} ms, {args.tokens_per_round} tokens a round per request, engine in {where}")
    print("| concurrency | served tok/s | ideal tok/s | served / ideal | TTFT mean ms | TPOT mean ms | e2e mean ms |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        c = run["concurrency"]
        ideal = min(c, args.num_prompts) * args.tokens_per_round / (args.step_ms / 1e3)
        served = run["output_throughput"]
        print(f"| {c} | {served:.0f} | {ideal:.0f} | {served / ideal:.2f} | {run['ttft_ms']['mean']:.2f} "
              f"| {run['tpot_ms']['mean']:.3f} | {run['e2e_ms']['mean']:.2f} |")


if __name__ == "__main__":
    main()
