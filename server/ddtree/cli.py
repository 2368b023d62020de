"""The `ddtree` command line: one sub-command per job, user errors as one line without a traceback."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ddtree.errors import DDTreeError

Handler = Callable[[argparse.Namespace], int]


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model directory (default: the embedded demo pair)")
    parser.add_argument("--draft", help="DFlash draft directory (default: the embedded demo pair's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--draft-vocab", metavar="FILE", default=None,
                        help="draft only these tokens (a file from `ddtree draft-vocab`, a JSON list of ids, or a "
                        ".pt tensor of ids): a cheaper draft step, the same output (default: the whole vocabulary)")
    _add_draft_quantization_arg(parser)
    _add_quantization_arg(parser)


def _add_quantization_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", choices=["none", "fp8"], default=None,
                        help="fp8: quantize a bf16 target's projections to float8 on load, per channel (half the "
                        "bytes of a decode step; needs compute capability 8.9+, or the CPU). FP8 checkpoints "
                        "(Qwen's ...-FP8, 128 x 128 block scales) load as fp8 without it (default: none)")


def _add_draft_quantization_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-quantization", choices=["none", "fp8"], default=None,
                        help="fp8: run the drafter's projections in float8 (half the bytes of its step; needs fp8 "
                        "tensor cores, compute capability 8.9+, or the CPU): a cheaper draft step, the same output, "
                        "acceptance may change a little (default: none, the model's dtype)")


def _add_generation_config_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--generation-config", choices=["auto", "none", "vllm"], default="auto",
                        help=f"auto (default): {what} take the target's generation_config.json values (Qwen3: "
                        "temperature 0.6, top_p 0.95, top_k 20), as vLLM does; none (or vllm, vLLM's name for it): "
                        "ignore the file")


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt and print the result")
    _add_model_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p.add_argument("--method", choices=["ddtree", "dflash", "ar"], default="ddtree")
    p.add_argument("--budget", type=int, default=None, help="DDTree node budget (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1 (off)")
    p.add_argument("--top-k", type=int, default=None, help="default: the model's, else 0 (off)")
    p.add_argument("--min-p", type=float, default=None, help="default: the model's, else 0 (off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages prompt and output tokens (default: the model's, else 1)")
    _add_generation_config_arg(p, "--temperature, --top-p, --top-k, --min-p and --repetition-penalty when not given")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA",
                       help="constrain the output to a JSON schema: a file, or the schema itself ('{}': any object)")
    shape.add_argument("--regex", help="constrain the output to match this regular expression")
    shape.add_argument("--choice", action="append", help="constrain the output to one of these strings (repeat)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                   help="static caches + CUDA graphs for greedy and sampled requests on Qwen3/Llama targets "
                        "(default: on when the model runs on CUDA; other requests use the reference path)")
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    import dataclasses

    from ddtree.core.sampling import SamplingParams
    from ddtree.engine import Engine
    from ddtree.engine.engine import GENERATION_KEYS

    given = {k: getattr(args, k) for k in GENERATION_KEYS if getattr(args, k) is not None}
    try:  # checked before the (slow) loading; the model's defaults fill in what was not given
        params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                grammar=_cli_grammar(args), **given)
    except ValueError as exc:
        raise DDTreeError(str(exc)) from None
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    engine = Engine.from_pretrained(args.target, args.draft, method=args.method, budget=args.budget,
                                    device=args.device, dtype=args.dtype, fast=args.fast, draft_vocab=args.draft_vocab,
                                    draft_quantization=args.draft_quantization, quantization=args.quantization)
    if engine.draft is not None:  # which rule each layer was drafted under: a wrong one only costs acceptance
        print(f"ddtree generate: draft: {engine.draft.config.describe()}", file=sys.stderr)
    if engine.fast is None and engine.fast_unsupported != "off":
        print(f"ddtree generate: reference path ({engine.fast_unsupported})", file=sys.stderr)
    elif engine.fast_note:
        print(f"ddtree generate: {engine.fast_note}", file=sys.stderr)
    auto = args.generation_config == "auto"
    model = {k: v for k, v in engine.generation_defaults.items() if k not in given} if auto else {}
    if model:
        params = dataclasses.replace(params, **model)
        print("ddtree generate: sampling defaults from the model's generation_config.json: "
              + ", ".join(f"{k}={v}" for k, v in model.items()), file=sys.stderr)
    if prompt_ids is None:
        prompt_ids = engine.encode(args.prompt, chat=args.chat)
    result = engine.generate(prompt_ids, params)
    text = engine.decode(result.token_ids)
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}))
    else:
        print(text)
        s = result.stats
        print(f"[{s.method}] {s.generated_tokens} tokens, {s.rounds} rounds, tau {s.acceptance_length:.2f}, "
              f"{s.tokens_per_second:.1f} tok/s, finish: {result.finish_reason}", file=sys.stderr)
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DDTreeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise DDTreeError("--prompt-ids is empty")
    return ids


def _cli_grammar(args: argparse.Namespace) -> str | None:
    """The grammar --json-schema / --regex / --choice ask for (ValueError with the reason), or None."""
    from ddtree.core import grammar

    if args.regex is not None:
        return grammar.regex_grammar(args.regex)
    if args.choice:
        return grammar.choice_grammar(args.choice)
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise ValueError(f"--json-schema: cannot read {args.json_schema}: {exc.strerror}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--json-schema is not JSON: {exc}") from None
    return grammar.json_schema_grammar(grammar.JSON_OBJECT if schema == {} else schema)


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    """Continuous batching, with vLLM's names and meanings."""
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests decoded together (default 64; 1: one at a time, as before batching)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="rows one engine step may process: prompt chunks, every request's root and draft nodes "
                        "(default 2048); longer prompts enter in chunks")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the server may take; the KV cache gets what the weights and "
                        "activations leave (default 0.9)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache slots per block (default 16)")
    p.add_argument("--batch-budget", action=argparse.BooleanOptionalAction, default=True,
                   help="choose each round's draft nodes across all requests by the round cost measured at "
                        "start-up (default on, on CUDA); --no-batch-budget: every request's own budget")
    p.add_argument("--single-request-path", action=argparse.BooleanOptionalAction, default=True,
                   help="a request alone decodes on the single-request fast path (its whole round in CUDA graphs) "
                        "and moves to the batched path when others arrive (default on, where the fast path runs)")
    p.add_argument("--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="prompts that start with a cached prefix reuse its KV blocks (and a hybrid's states) and "
                        "prefill only the rest (default on; --no-enable-prefix-caching: every prompt in full)")


def _batch_options(args: argparse.Namespace):
    from ddtree.engine.batch import BatchOptions

    return BatchOptions(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                        batch_budget=args.batch_budget, single_request_path=args.single_request_path,
                        prefix_caching=args.prefix_caching)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (with Prometheus /metrics)")
    _add_model_args(p)
    p.add_argument("--shape", default=None,
                   help="serve a random-weight target and drafter of this shape instead of a checkpoint, with the "
                   "demo tokenizer: qwen3-8b, qwen3.6-27b (hybrid), qwen3-30b-a3b (MoE), or the tiny ones (the names "
                   "`ddtree bench --shape` takes); to measure a GPU at a model's size, replies are noise")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: target dir name)")
    p.add_argument("--method", choices=["ddtree", "dflash", "ar"], default="ddtree")
    p.add_argument("--budget", type=int, default=None, help="DDTree node budget (default: 32)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before new ones get 429")
    _add_batch_args(p)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1, /tokenize, /detokenize "
                   "and the API docs (default: $DDTREE_API_KEY; none: open)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json (as vLLM's flag; with --api-key they need the key)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM; what is left then gets a 503")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20, metavar="BYTES",
                   help="larger request bodies get a 413 before they are read (default: 4194304, 4 MiB)")
    p.add_argument("--escape-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="read special-token text in chat messages (a user's `<|im_end|>`) as plain text, so no "
                   "message can forge a turn (default: on; --no-escape-special-tokens tokenizes it as the "
                   "special token, as vLLM does)")
    p.add_argument("--default-temperature", type=float, default=None,
                   help="temperature for requests that send none, over the model's (default: the model's "
                   "generation config, else 1.0 as OpenAI; 0 = greedy)")
    _add_generation_config_arg(p, "requests that leave out temperature, top_p, top_k, min_p or repetition_penalty")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy and sampled requests on the fast path (static caches, fused kernels, CUDA graphs; "
                        "dense Qwen3/Llama targets and Qwen3.5/3.6 hybrids). Default: on when the model runs on CUDA")
    p.add_argument("--default-chat-template-kwargs", metavar="JSON", default=None,
                   help="chat template arguments every chat gets unless it sets the same key, e.g. "
                        "'{\"enable_thinking\": false}' (Qwen3: DFlash drafters were trained without thinking)")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "none"], default="auto",
                   help="how replies become `tool_calls`: hermes (<tool_call> JSON blocks: Qwen3, Qwen2.5); "
                        "auto (default): hermes when the chat template writes such blocks; none: tools refused")
    p.add_argument("--reasoning-parser", choices=["auto", "qwen3", "none"], default="auto",
                   help="return <think> blocks as reasoning_content: qwen3; auto (default): when the chat "
                        "template knows </think>; none: leave them in the content")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the models and their steps in a process of their own, so the HTTP front end "
                        "(detokenizing, streaming) works while the engine steps (default: on; "
                        "--no-engine-process: one process, e.g. to profile it whole)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import os

    from ddtree.api.serve import ServeOptions, run

    if args.shape is not None:
        from ddtree.models.shapes import check_shape

        if args.target or args.draft:
            raise DDTreeError("--shape serves a random-weight model: leave out --target and --draft")
        check_shape(args.shape)  # here, before an engine process starts
    if not 0 <= args.port <= 65535:
        raise DDTreeError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise DDTreeError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.max_request_bytes < 1024:
        raise DDTreeError(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    if not args.drain_timeout >= 0:
        raise DDTreeError(f"--drain-timeout must be 0 or more seconds, got {args.drain_timeout}")
    if args.default_temperature is not None and not 0 <= args.default_temperature <= 2:
        raise DDTreeError(f"--default-temperature must be in [0, 2], got {args.default_temperature}")
    template_kwargs = {}
    if args.default_chat_template_kwargs is not None:
        try:
            template_kwargs = json.loads(args.default_chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise DDTreeError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
        if not isinstance(template_kwargs, dict):
            raise DDTreeError("--default-chat-template-kwargs must be a JSON object")
        from ddtree.api.rendering import template_kwargs_refusal

        if (refusal := template_kwargs_refusal(template_kwargs)) is not None:
            raise DDTreeError(f"--default-chat-template-kwargs {refusal}")
    return run(ServeOptions(
        target=args.target, draft=args.draft, shape=args.shape, draft_vocab=args.draft_vocab,
        draft_quantization=args.draft_quantization, quantization=args.quantization, method=args.method,
        budget=args.budget,
        device=args.device, dtype=args.dtype, host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("DDTREE_API_KEY") or None, max_queue=args.max_queue,
        drain_timeout=args.drain_timeout, default_temperature=args.default_temperature,
        generation_config=args.generation_config, fast=args.fast,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=template_kwargs, batch=_batch_options(args),
        max_request_bytes=args.max_request_bytes,
        escape_special_tokens=args.escape_special_tokens, docs=not args.disable_fastapi_docs,
        engine_process=args.engine_process, log_level=args.log_level))


def _add_pull_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="fetch models for `ddtree serve` (Hub download, or link a local/pvc path)",
                       description="Pull each URI into its DEST, all pairs concurrently. A completed pull is "
                       "not repeated.")
    p.add_argument("pairs", nargs="+", metavar="URI DEST",
                   help="hf://org/name[@revision], pvc://claim/path or /local/path, then its destination")
    p.add_argument("--token-env", action="append", default=[], metavar="VAR",
                   help="environment variable holding the Hub token: once for all pairs or once per pair "
                   "(default: HF_TOKEN)")
    p.add_argument("--progress", choices=["text", "json", "none"], default="text",
                   help="text lines on stderr, or JSON lines on stdout for the operator")
    p.add_argument("--progress-interval", type=float, default=5.0, metavar="SECONDS")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="give up (exit 2) if the pull has not finished by then; a later pull resumes it "
                   "(default: no limit)")
    p.set_defaults(handler=_pull)


def _pull(args: argparse.Namespace) -> int:
    import os

    from ddtree.models.pull import Progress, pull

    if len(args.pairs) % 2:
        raise DDTreeError("expected URI DEST pairs, got an odd number of arguments")
    if args.timeout is not None and args.timeout <= 0:
        raise DDTreeError(f"--timeout must be positive, got {args.timeout:g}")
    pairs = list(zip(args.pairs[::2], args.pairs[1::2], strict=True))
    names = args.token_env or ["HF_TOKEN"]
    if len(names) == 1:
        names = names * len(pairs)
    if len(names) != len(pairs):
        raise DDTreeError(f"--token-env given {len(names)} times for {len(pairs)} pairs; "
                          "give it once, or once per pair")
    outcomes = pull(pairs, [os.environ.get(n) or None for n in names],
                    Progress(args.progress, interval=args.progress_interval), timeout=args.timeout)
    for (uri, dest), outcome in zip(pairs, outcomes, strict=True):
        print(f"{uri} -> {dest}: {outcome}", file=sys.stderr)
    return 0


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                   help="text files or directories (walked for --glob); 1 file in 50 is held out for evaluation")
    p.add_argument("--glob", default="*.py,*.txt,*.md,*.rst", help="comma-separated file patterns for directories")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seq-len", type=int, default=512, help="training window in tokens")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1000 unless --minutes)")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget; stops at whichever comes first")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=200, help="held-out evaluation interval in steps")


def _add_train_target_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-target", help="train a small Qwen3 causal LM (and its tokenizer) on local text")
    _add_corpus_args(p)
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer directory (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=8192, help="size of a newly trained tokenizer")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.set_defaults(handler=_train_target)


def _train_target(args: argparse.Namespace) -> int:
    from ddtree.training.target import TargetArch, train_target

    arch = TargetArch(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                      head_dim=args.head_dim, intermediate=args.intermediate, max_positions=max(1024, args.seq_len))
    train_target(args.corpus, args.out, arch=arch, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                 globs=args.glob.split(","), seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                 steps=args.steps, minutes=args.minutes, device=args.device, seed=args.seed,
                 eval_every=args.eval_every)
    return 0


def _add_train_draft_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train a DFlash or DFlash2 drafter for a frozen target on local text")
    p.add_argument("--target", required=True, help="target model directory (transformers format, with tokenizer)")
    _add_corpus_args(p)
    p.add_argument("--layers", type=int, default=5, help="draft depth")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--taps", default="auto", help="'auto' (z-lab default) or target layer ids, e.g. 1,9,17")
    p.add_argument("--blocks", type=int, default=16, help="random anchors (blocks) trained per window")
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block slots: exp(-(k-1)/gamma)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--save-every", type=int, default=1000, help="checkpoint interval in steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --out (its config wins over --layers/--taps/--block-size, "
                   "--arch, --causal and the DFlash2 fields)")
    p.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="dflash2: add DFlash2's convolutions and candidate selector (default: dflash)")
    p.add_argument("--causal", action="store_true",
                   help="causal layers inside the block (default: bidirectional); written as is_causal")
    p.add_argument("--selector-top-k", type=int, default=16, help="dflash2: candidates per position")
    p.add_argument("--selector-rank", type=int, default=256, help="dflash2: rank of the selector's codebooks")
    p.add_argument("--conv-kernel-size", type=int, default=2, help="dflash2: taps of each convolution")
    p.add_argument("--conv-group-size", type=int, default=16, help="dflash2: channels sharing a dynamic tap")
    p.set_defaults(handler=_train_draft)


def _train_draft(args: argparse.Namespace) -> int:
    from ddtree.models.dflash2 import SelectorConfig
    from ddtree.training.drafter import train_draft

    selector = SelectorConfig(conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                              selector_rank=args.selector_rank, selector_top_k=args.selector_top_k)
    train_draft(args.target, args.corpus, args.out, layers=args.layers, block_size=args.block_size, taps=args.taps,
                globs=args.glob.split(","), seq_len=args.seq_len, blocks=args.blocks, batch_size=args.batch_size,
                lr=args.lr, gamma=args.gamma, steps=args.steps, minutes=args.minutes, device=args.device,
                seed=args.seed, eval_every=args.eval_every, save_every=args.save_every, resume=args.resume,
                arch=args.arch, causal=args.causal, selector=selector)
    return 0


def _add_draft_vocab_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draft-vocab", help="count a corpus's tokens: the most frequent ones, for --draft-vocab",
                       description="Write the SIZE tokens of the target's tokenizer most frequent in a local corpus "
                       "(its held-out files excluded), stop tokens always among them. `ddtree serve --draft-vocab "
                       "FILE` then drafts only those tokens: a cheaper draft step, the same output.")
    p.add_argument("--target", required=True, help="target model directory (its tokenizer and config)")
    p.add_argument("--corpus", nargs="+", required=True, metavar="PATH", help="text files or directories")
    p.add_argument("--glob", default="*.py,*.txt,*.md,*.rst", help="comma-separated file patterns for directories")
    p.add_argument("--size", type=int, default=32768, help="tokens to keep (default: 32768)")
    p.add_argument("--out", required=True, help="output file (JSON)")
    p.set_defaults(handler=_draft_vocab)


def _draft_vocab(args: argparse.Namespace) -> int:
    from ddtree.training.draft_vocab import build_from_corpus

    build_from_corpus(args.target, args.corpus, args.size, args.out, args.glob.split(","))
    return 0


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="ar, dflash and ddtree side by side, fast and eager paths, one process")
    p.add_argument("--target", help="target model directory (default: the embedded demo pair)")
    p.add_argument("--draft", help="DFlash draft directory (default: the demo pair's)")
    p.add_argument("--shape", help="a random-weight model instead: qwen3-8b, qwen3.6-27b (hybrid), "
                   "qwen3-30b-a3b (MoE), tiny, tiny-hybrid, tiny-moe")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="weights and activations (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--methods", nargs="+", choices=["ar", "dflash", "ddtree"], default=["ar", "dflash", "ddtree"])
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--paths", nargs="+", choices=["fast", "eager"], default=["fast", "eager"],
                   help="fast: static caches + CUDA graphs; eager: the reference loop")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--corpus", default=None, help="held-out prompt files for a real pair (default: the stdlib)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (outputs checked against ar); above 0, sampled runs compared by speed and tau")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampled runs: prompt i uses seed + i")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="ask for each token's log-probability and its K best alternatives, as a client would")
    p.add_argument("--draft-vocab", metavar="FILE|N", default=None,
                   help="draft only these tokens: a draft vocabulary file, or N for the N lowest ids (a --shape's "
                   "costs; its random weights make every choice of tokens alike)")
    _add_draft_quantization_arg(p)
    p.add_argument("--quantization", choices=["none", "fp8"], default=None,
                   help="fp8: the target's projections in float8: on a --shape its random weights in the FP8 "
                   "checkpoints' 128 x 128 blocks, on a loaded pair quantized per channel on load (default: none)")
    p.add_argument("--concurrency", nargs="+", type=int, default=None, metavar="C",
                   help="continuous batching instead: output tok/s with C requests in flight, for ar, dflash, "
                        "ddtree at the first --budgets value and ddtree under the batch budget")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="with --concurrency: rows a step")
    p.add_argument("--single-request-path", action=argparse.BooleanOptionalAction, default=True,
                   help="with --concurrency: a request alone takes the single-request path, as in the server "
                        "(--no-single-request-path: the batched path at concurrency 1 too)")
    p.add_argument("--tau-curve", metavar="JSON", default=None,
                   help="with --concurrency on a --shape: a --json report of a real pair, whose tau by budget "
                        "projects the shape's tok/s (labelled a projection)")
    p.add_argument("--profile", nargs="?", type=int, const=4, default=None, metavar="STEPS",
                   help="also profile STEPS decode steps (default 4) of each run (with --concurrency, each method at "
                        "each level; else the fast path's runs): time a step by kind of layer against its bytes")
    p.add_argument("--json", help="also write the full results here")
    p.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    if args.concurrency:
        from ddtree.bench.concurrency import bench_concurrency

        return bench_concurrency(args)
    from ddtree.bench.command import bench

    return bench(args)


def _add_bench_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-serve", help="load a running OpenAI-compatible server over HTTP (as vllm bench serve)",
                       description="Stream --num-prompts requests to a running server at each --concurrency level "
                       "and report throughput, TTFT, TPOT, ITL and E2E percentiles, failures, and the mean "
                       "acceptance length from its /metrics. Exits 1 when any request failed.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model id to ask for (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $DDTREE_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (default: completions)")
    p.add_argument("--dataset", default="random", metavar="random|shared-prefix|FILE.jsonl",
                   help="random: --input-len random words per prompt; shared-prefix: one common prefix of "
                   "--prefix-len words, then --input-len words of each prompt's own (prefix caching); or a JSONL "
                   "file with one {\"prompt\": ...} or {\"messages\": [...]} per line (an optional \"max_tokens\" "
                   "each), cycled (default: random)")
    p.add_argument("--input-len", type=int, default=128,
                   help="random and shared-prefix datasets: a prompt's own words (default 128)")
    p.add_argument("--prefix-len", type=int, default=1500,
                   help="shared-prefix dataset: words of the prefix every prompt starts with (default 1500)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per concurrency level (default 100)")
    p.add_argument("--concurrency", nargs="+", type=int, default=None, metavar="C",
                   help="most requests in flight; several values sweep them in one run (default: no limit)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, every request at once)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="decode max_tokens every time (vLLM's extension)")
    p.add_argument("--seed", type=int, default=0, help="random prompts and arrival times (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--json", metavar="PATH", help="also write the report, per-request figures included, here")
    p.set_defaults(handler=_bench_serve)


def _bench_serve(args: argparse.Namespace) -> int:
    from ddtree.bench.serve_load import bench_serve

    return bench_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_pull_parser(sub)
    _add_train_target_parser(sub)
    _add_train_draft_parser(sub)
    _add_draft_vocab_parser(sub)
    _add_bench_parser(sub)
    _add_bench_serve_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except DDTreeError as exc:
        print(f"ddtree {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
