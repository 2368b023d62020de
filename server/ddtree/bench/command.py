"""`ddtree bench`: ar, dflash and ddtree side by side, in one process, on the same prompts.

For each decoding path (`fast`: ddtree.fast, static caches and CUDA graphs; `eager`: the reference loop) and
each method, every prompt is decoded after a warm-up: greedily by default, where outputs must equal `ar`'s;
or sampled (`--temperature`, `--top-p`, `--top-k`, `--min-p`; prompt i seeded with seed + i), as most
OpenAI clients ask, where only the speed and τ are compared (samples of one distribution differ). Reported per run:
TPOT, tokens/s, τ, the mean time per round of each phase (draft, tree, verify, commit, host = the rest of
the round's wall time), round time and verify time relative to one AR step on the same path, and the
batch-1 bandwidth floor of one target step (weights + KV + recurrent state, see weight_bytes).

Models: a target/draft pair from disk (default: the embedded demo pair, real τ) or `--shape NAME`, a
random-weight target and DFlash draft of a published shape, built on the GPU in bf16 (per-round costs; τ
is meaningless there): `qwen3-8b` (Qwen3-8B + Qwen3-8B-DFlash-b16) or `qwen3.6-27b` (the Qwen3.6-27B text
stack, 48 Gated DeltaNet + 16 gated attention layers, + its DFlash draft); `tiny` and `tiny-hybrid` are
their smoke-test miniatures. Where the fast path declines a target (see ddtree.fast.unsupported), the bench
runs the eager path only, says so on stderr and reports `fast_path: "declined: <reason>"`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no read-bandwidth kernel (read_bandwidth gives None)
    triton = None

from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.engine import DTYPES
from ddtree.errors import DDTreeError
from ddtree.fast.layers import weight_of
from ddtree.kernels.fp8 import Fp8Weight
from ddtree.kernels.jit import OutOfResources, triton_works
from ddtree.models.draft import DFlashDraft
from ddtree.models.draft_vocab import load_draft_vocab
from ddtree.models.quantize import Fp8Linear
from ddtree.models.target import HybridTarget, Target

SPEC_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s (datasheet)


def hybrid_shape(target: dict, draft: dict) -> dict:
    """A Qwen3.5/3.6-style shape: three Gated DeltaNet layers then one gated attention layer, repeated; partial
    RoPE. Its DFlash draft (Qwen3.6-27B-DFlash's layout unless `draft` says otherwise) keeps a 2048-token
    sliding window in every layer but the last."""
    vocab, layers, draft_layers = target["vocab_size"], target["num_hidden_layers"], draft["num_layers"]
    return dict(
        target=dict(target, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                    linear_conv_kernel_dim=4, max_position_embeddings=262144, initializer_range=0.02,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
        draft=dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, mask_token_id=vocab - 2,
                   rope_theta=1e7, max_position_embeddings=262144, sliding_window=2048,
                   layer_types=["sliding_attention"] * (draft_layers - 1) + ["full_attention"]) | draft)


SHAPES = {
    "qwen3-8b": dict(
        target=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False),
        draft=dict(num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                   block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], rope_theta=1e6)),
    # Qwen3.6-27B text stack: 64 layers = 48 Gated DeltaNet + 16 gated attention (every 4th).
    "qwen3.6-27b": hybrid_shape(
        target=dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
        draft=dict(num_layers=5, intermediate_size=17408, target_layer_ids=[1, 16, 31, 46, 61])),
    # Qwen3-Coder-30B-A3B (128 experts, 8 per token). Its DFlash draft's config is not in our references: this
    # one takes the 8B draft's layout at the target's width.
    "qwen3-30b-a3b": dict(
        target=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=262144,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7}, tie_word_embeddings=False,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
        draft=dict(num_layers=5, num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                   block_size=16, mask_token_id=151669, target_layer_ids=[1, 12, 23, 34, 45], rope_theta=1e7)),
    # The tiny shapes run anywhere in seconds: for smoke tests of the suite itself.
    "tiny": dict(
        target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=False),
        draft=dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=8,
                   mask_token_id=511, target_layer_ids=[1, 2], rope_theta=1e4)),
    "tiny-moe": dict(
        target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=False,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
        draft=dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=8,
                   mask_token_id=511, target_layer_ids=[1, 2], rope_theta=1e4)),
    "tiny-hybrid": hybrid_shape(
        target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
        draft=dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=8,
                   target_layer_ids=[1, 2])),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_target(shape: dict, device: torch.device, dtype: torch.dtype) -> Target:
    """The random-weight target of a shape, its weights born in `dtype` on `device` (a 27B model never
    exists in fp32); a HybridTarget when the shape has linear-attention layers, a Qwen3-MoE model when it
    has experts."""
    import transformers

    hybrid = "linear_attention" in shape["target"].get("layer_types", ())
    family = "Qwen3_5" if hybrid else "Qwen3Moe" if "num_experts" in shape["target"] else "Qwen3"
    config = getattr(transformers, f"{family}TextConfig" if hybrid else f"{family}Config")(**shape["target"])
    with born(device, dtype):
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    return HybridTarget(model) if hybrid else Target(model)


def build_draft(shape: dict, target: Target, device: torch.device, dtype: torch.dtype) -> DFlashDraft:
    """The random-weight DFlash draft of a shape, for `target`, born in `dtype` on `device`."""
    from ddtree.models.draft import draft_config_dict, parse_draft_config

    t = shape["target"]
    cfg = draft_config_dict(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"],
                            num_target_layers=t["num_hidden_layers"], **shape["draft"])
    with born(device, dtype):
        draft = DFlashDraft(parse_draft_config(cfg, target.shape))
    return draft.place(device, dtype).eval()  # RoPE frequencies in fp32


@contextlib.contextmanager
def born(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create tensors on `device` in `dtype` inside the block; torch's default dtype is restored after."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def build_shape(name: str, device: torch.device, dtype: torch.dtype, fast_capacity: int,
                draft_vocab: str | None = None, draft_quantization: str | None = None) -> tuple[Engine, Engine]:
    """(fast engine, eager engine) over one random-weight model of a published shape, built on the device.

    Seeded, so that runs of one shape compare the same weights.
    """
    torch.manual_seed(0)
    target = build_target(SHAPES[name], device, dtype)
    draft = build_draft(SHAPES[name], target, device, dtype)
    hot = draft_vocab_ids(draft_vocab, target.shape.vocab_size)
    fast = Engine(target, draft, fast=True, fast_capacity=fast_capacity, model_name=name, draft_vocab=hot,
                  draft_quantization=draft_quantization)
    return fast, Engine(target, draft, model_name=name, draft_vocab=fast.draft_head,
                        draft_quantization=draft_quantization)


def build_pair(target: str | None, draft: str | None, device: str, dtype: str | None, fast_capacity: int,
               draft_vocab: str | None = None, draft_quantization: str | None = None) -> tuple[Engine, Engine]:
    """(fast engine, eager engine) over one loaded pair: the fast path's static caches are built once, after
    the draft vocabulary (a file, or N lowest ids) is known. Both share one (quantized) draft and head."""
    loaded = Engine.from_pretrained(target, draft, device=device, dtype=dtype)
    hot = draft_vocab_ids(draft_vocab, loaded.vocab_size)
    pair = (loaded.target, loaded.draft, loaded.tokenizer)
    fast = Engine(*pair, model_name=loaded.model_name, fast=True, fast_capacity=fast_capacity, draft_vocab=hot,
                  draft_quantization=draft_quantization)
    return fast, Engine(*pair, model_name=loaded.model_name, draft_vocab=fast.draft_head,
                        draft_quantization=draft_quantization)


def draft_vocab_ids(spec: str | None, vocab_size: int) -> list[int] | None:
    """--draft-vocab: a draft vocabulary file's ids, or for a number N the N lowest ids (what a random-weight
    shape's costs need: any N tokens cost the same)."""
    if spec is None:
        return None
    if spec.isdigit():
        if not 1 <= int(spec) <= vocab_size:
            raise DDTreeError(f"--draft-vocab must be in 1..{vocab_size} tokens, got {spec}")
        return list(range(int(spec)))
    return load_draft_vocab(spec, vocab_size)


def prompts_for(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    """Held-out source files for a real pair (text it never trained on); random ids for a random-weight shape."""
    if args.shape:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.target.shape.vocab_size
        return [torch.randint(0, vocab - 2, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    from ddtree.training.corpus import find_files, read_texts, split_files

    _, held = split_files(find_files([args.corpus or sysconfig.get_paths()["stdlib"]], ["*.py"]))
    texts = [t for t in read_texts(held) if len(t) > 4 * args.prompt_tokens][:args.prompts]
    return [engine.encode(t)[:args.prompt_tokens] for t in texts]


def weight_bytes(engine: Engine, context: int) -> int:
    """Bytes one batch-1 target step must move at least: its time floor at a given bandwidth.

        weights  every parameter, less the input embedding unless tied to the LM head (a step reads one row),
                 and of a mixture-of-experts layer's experts only the k of E a token picks
      + KV       2 x attention layers x kv_heads x head_dim x dtype bytes x context, the attention layers
                 being all but the linear-attention (Gated DeltaNet) ones
      + state    2 x linear-attention layers x gdn_state_bytes: each layer's state is read and written once
    """
    model, cfg = engine.target.model, engine.target.config
    embed = engine.target.embed_tokens.weight
    size = embed.element_size()
    tied = engine.target.lm_head.weight.data_ptr() == embed.data_ptr()
    params = nbytes(model.parameters())
    experts = nbytes(p for layer in engine.target.layers
                     for p in getattr(layer.mlp, "experts", nn.Module()).parameters())
    unpicked = experts - experts * getattr(cfg, "num_experts_per_tok", 0) // getattr(cfg, "num_experts", 1)
    weights = params - unpicked - (0 if tied else embed.numel() * size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    linear = engine.target.layer_types.count("linear_attention")
    kv = 2 * (cfg.num_hidden_layers - linear) * cfg.num_key_value_heads * head_dim * size * context
    state = 2 * linear * gdn_state_bytes(cfg, size) if linear else 0
    return weights + kv + state


def draft_bytes(engine: Engine, context: int) -> int:
    """Bytes a speculative round moves at least on top of the target step's (dflash and ddtree rounds):

        draft    every draft weight: the block pass reads its layers, the commit its fc (fp8 ones with their
                 scales, for a quantized draft)
      + K, V     the draft layers' K and V projections once more: the commit projects the committed rows with them
      + LM head  the target's (or its rows of a draft vocabulary, or their fp8 copy), which scores the block's rows
      + KV       2 x draft layers x kv_heads x head_dim x dtype bytes x context (the draft's context cache)
    """
    draft, cfg = engine.draft, engine.draft.config
    fp8 = [m.fp8 for m in draft.modules() if isinstance(m, Fp8Linear)]
    again = sum(_weight_bytes(weight_of(m)) for layer in draft.layers
                for m in (layer.self_attn.k_proj, layer.self_attn.v_proj))
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * draft.norm.weight.element_size() * context
    weights = nbytes(draft.parameters()) + sum(w.nbytes for w in fp8)
    return weights + again + _weight_bytes(engine.draft_head.weight) + kv


def _weight_bytes(weight: torch.Tensor | Fp8Weight) -> int:
    return weight.nbytes if isinstance(weight, Fp8Weight) else nbytes([weight])


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def gdn_state_bytes(cfg, dtype_bytes: int) -> int:
    """One Gated DeltaNet layer's state as ddtree.models.hybrid.HybridCache keeps it: the recurrent state
    value_heads x key_dim x value_dim in fp32, and the conv window conv_dim x (kernel - 1) in the model's dtype,
    conv_dim = 2 x key_heads x key_dim + value_heads x value_dim (q, k and v are convolved)."""
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv_dim = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    return recurrent + conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes


def graph_ms(fn: Callable[[], object], reps: int = 15, rewrite: Callable[[int], object] | None = None) -> float:
    """Median ms of one replay of `fn` captured as a CUDA graph (warmed up on a side stream first; the first
    replays are dropped). `rewrite` gets the captured cudaGraph_t before it is instantiated (a probe's edge
    rewrite: benchmarks/blas_pdl_probe.py)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=rewrite is not None)
    with torch.cuda.graph(graph):
        fn()
    if rewrite is not None:
        rewrite(graph.raw_cuda_graph())
        graph.instantiate()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


CYCLED_CALLS = 36  # calls per timing in the kernel scripts (benchmarks/*_tune.py): one per layer of an 8B step


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Random bf16 [n, k] weights on the GPU, enough distinct copies (2 GiB in all, 2 to CYCLED_CALLS of them)
    that calls cycling over them read memory, not L2."""
    copies = max(2, min(CYCLED_CALLS, -(-2 * 2**30 // (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]


def cycled_us(fn: Callable[..., object], weights: list, rewrite: Callable[[int], object] | None = None) -> float:
    """µs per call of fn(weight): CYCLED_CALLS calls cycling over `weights`, replayed as one CUDA graph
    (`rewrite`: graph_ms's)."""
    def calls() -> None:
        for i in range(CYCLED_CALLS):
            fn(weights[i % len(weights)])
    return 1e3 * graph_ms(calls, rewrite=rewrite) / CYCLED_CALLS


def grid_us(call: Callable[[object, dict], torch.Tensor], weights: list, want: torch.Tensor, configs: Iterable[dict],
            wrong: Callable[[dict, float], None]) -> list[tuple[float, str]]:
    """(µs per call, config) of `call(weight, config)` for each launch config of a tuning grid, fastest first
    (cycled_us over `weights`). Each config's output for weights[0] is checked against `want` first: a wrong one
    goes to `wrong(config, largest difference)` and is not timed; one whose tiles outgrow the GPU is left out."""
    timed = []
    for cfg in configs:
        try:
            got = call(weights[0], cfg).float()
        except OutOfResources:
            continue
        if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
            wrong(cfg, (got - want).abs().max().item())
            continue
        timed.append((cycled_us(lambda w, cfg=cfg: call(w, cfg), weights), str(cfg)))
    return sorted(timed)


def copy_bandwidth(device: torch.device) -> float | None:
    """Measured device-to-device bandwidth of a copy kernel (bytes read + written per second), median of graph
    replays. A kernel, not `copy_`: in a graph that becomes a memcpy node, which the slower copy engines run."""
    if device.type != "cuda":
        return None
    src = torch.randn(256 * 2**20, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (graph_ms(lambda: torch.neg(src, out=dst)) / 1e3)


READ_BLOCK = 8192  # elements per program: on an H200 4.62 TB/s, against 4.22 for torch.sum (RESULTS v16)


def read_bandwidth(device: torch.device) -> float | None:
    """Measured read bandwidth (bytes per second) of a kernel that only reads 1 GiB, median of graph replays.

    A decode step's weights are only read, and a read streams about 10 % faster than a copy, which also
    writes: so this, not the copy, is the floor a memory-bound step can approach. None without a CUDA device
    on which Triton runs."""
    if device.type != "cuda" or not triton_works(device):
        return None
    data = torch.randn(2**29, device=device, dtype=torch.bfloat16)  # 1 GiB
    sums = torch.empty(data.numel() // READ_BLOCK, device=device)
    return data.numel() * data.element_size() / (graph_ms(lambda: read_sums(data, sums)) / 1e3)


def read_sums(data: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """sums[i] = the sum of data's i-th READ_BLOCK elements (every element read once; data.numel() a multiple
    of READ_BLOCK)."""
    _read_kernel[(sums.numel(),)](data, sums, BLOCK=READ_BLOCK, num_warps=4)
    return sums


if triton is not None:

    @triton.jit
    def _read_kernel(X, Sums, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Sums + pid, tl.sum(tl.load(X + offsets).to(tl.float32)))


def run(engine: Engine, prompts: list[list[int]], method: str, budget: int, params: SamplingParams) -> dict:
    """Decode every prompt (after one warm-up that also captures the graphs, and compiles the steps the first
    time: its wall time is `warmup_s`, what a server's warm-up costs per plan); totals and per-round means."""
    started = time.perf_counter()
    engine.generate(prompts[0], replace(params, max_new_tokens=16), method=method, budget=budget)
    warmup_s = time.perf_counter() - started
    totals = dict(rounds=0, committed=0, decoded=0, seconds=0.0)
    phases: dict[str, float] = {}
    outputs, on_fast = [], True
    for i, ids in enumerate(prompts):
        seed = None if params.seed is None else params.seed + i
        gen = engine.stream(ids, replace(params, seed=seed), method=method, budget=budget)
        on_fast &= gen.backend.name == "fast"
        for _ in gen:
            pass
        s = gen.stats
        outputs.append(gen.token_ids)
        totals["rounds"] += s.rounds
        totals["committed"] += s.committed_tokens
        totals["decoded"] += max(s.generated_tokens - 1, 0)
        totals["seconds"] += s.decode_seconds
        for name, seconds in s.phase_seconds.items():
            phases[name] = phases.get(name, 0.0) + seconds
    rounds = max(totals["rounds"], 1)
    per_round = {name: 1e3 * seconds / rounds for name, seconds in phases.items()}
    per_round["host"] = per_round.get("host", 0.0) + max(1e3 * totals["seconds"] / rounds - sum(per_round.values()), 0)
    round_ms = 1e3 * totals["seconds"] / rounds
    graphs = None
    if on_fast and engine.fast:
        graphs = engine.fast.plan_for(method, budget, params).eager_reason or "graphs"
    return dict(method=method, budget=budget if method == "ddtree" else None, on_fast_path=on_fast, graphs=graphs,
                tau=totals["committed"] / rounds, tpot_ms=1e3 * totals["seconds"] / max(totals["decoded"], 1),
                tokens_per_second=totals["decoded"] / totals["seconds"] if totals["seconds"] else 0.0,
                round_ms=round_ms, phase_ms=per_round,
                non_verify_share=1 - per_round.get("verify", 0.0) / round_ms if round_ms else 0.0,
                rounds=totals["rounds"], warmup_s=warmup_s, outputs=outputs)


def bench(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DDTreeError("--device cuda was asked for, but no CUDA device is available")
    if args.shape and args.shape not in SHAPES:
        raise DDTreeError(f"unknown shape {args.shape!r}; choose one of {', '.join(SHAPES)}")
    if any(b < 1 for b in args.budgets):
        raise DDTreeError("budgets must be >= 1")
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=True,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                repetition_penalty=args.repetition_penalty, logprobs=args.logprobs)
    except ValueError as exc:
        raise DDTreeError(str(exc)) from None
    capacity = args.prompt_tokens + args.max_new_tokens + max(args.budgets) + 64
    log(f"building {'shape ' + args.shape if args.shape else 'pair'} on {device}")
    if args.shape:
        dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
        fast, eager = build_shape(args.shape, device, dtype, capacity, args.draft_vocab, args.draft_quantization)
    else:
        fast, eager = build_pair(args.target, args.draft, str(device), args.dtype, capacity, args.draft_vocab,
                                 args.draft_quantization)
    paths = paths_to_run(args.paths, fast)
    prompts = prompts_for(fast, args)
    if not prompts:
        raise DDTreeError("no prompts (no held-out files long enough in --corpus)")
    ceilings = [measured_ceilings(device)]
    context = args.prompt_tokens + args.max_new_tokens // 2
    step_bytes = weight_bytes(fast, context)
    runs = [(m, b) for m in args.methods for b in (args.budgets if m == "ddtree" else [0])]
    results = []
    for path in paths:
        engine = fast if path == "fast" else eager
        for method, budget in runs:
            log(f"{path} {method}{' B=' + str(budget) if budget else ''} ...")
            t = time.perf_counter()
            r = run(engine, prompts, method, budget or 1, params)
            r["path"] = path
            results.append(r)
            log(f"  {r['tokens_per_second']:.1f} tok/s, tau {r['tau']:.2f} (warm-up {r['warmup_s']:.1f} s, "
                f"{time.perf_counter() - t:.1f} s in all)")
    for r in results:
        ar = next((a for a in results if a["path"] == r["path"] and a["method"] == "ar"), None)
        compare = ar is not None and params.greedy  # samples are compared by τ and speed, not token by token
        r["lossless"] = r["outputs"] == ar["outputs"] if compare else None
        r["prefix_match"] = prefix_match(r["outputs"], ar["outputs"]) if compare else None
        r["round_vs_ar_step"] = r["round_ms"] / ar["round_ms"] if ar else None
        r["verify_vs_ar_step"] = r["phase_ms"].get("verify", 0.0) / ar["phase_ms"]["verify"] if ar else None
    ceilings.append(measured_ceilings(device))
    copy, read = (max((c[i] for c in ceilings if c[i]), default=None) for i in (0, 1))
    round_bytes = step_bytes + draft_bytes(fast, context)
    floor_ms = floors(step_bytes, copy, read)
    round_floor_ms = floors(round_bytes, copy, read)
    achievable = list(floor_ms)[-1]  # the tightest: read, else copy, else the datasheet
    for r in results:
        floor = (floor_ms if r["method"] == "ar" else round_floor_ms)[achievable]
        r["round_vs_floor"] = r["round_ms"] / floor
    report = dict(model=args.shape or fast.model_name, device=torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", dtype=str(fast.target.dtype).removeprefix("torch."),
                  torch=torch.__version__, prompts=len(prompts),
                  prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, sampling=describe(params),
                  vocab_size=fast.vocab_size, draft_vocab=fast.draft_head.size if fast.draft_head else None,
                  draft_quantization=fast.draft_quantization,
                  step_bytes=step_bytes, round_bytes=round_bytes,
                  copy_bandwidth=copy, read_bandwidth=read, floor_ms=floor_ms, round_floor_ms=round_floor_ms,
                  round_vs_floor_at=achievable, draft_share_of_round_floor=1 - step_bytes / round_bytes,
                  fast_path="available" if fast.fast else f"declined: {fast.fast_unsupported}", results=results)
    if len(paths) == 2 and "ar" in args.methods and params.greedy:
        fast_ar, eager_ar = (next(r for r in results if r["path"] == p and r["method"] == "ar") for p in paths)
        report["fast_vs_eager_ar_prefix_match"] = prefix_match(fast_ar["outputs"], eager_ar["outputs"])
    for r in results:
        r.pop("outputs")
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def measured_ceilings(device: torch.device, tries: int = 3) -> tuple[float | None, float | None]:
    """(copy, read) bandwidth now, each the best of `tries`: right after the models were built, a first copy
    measurement has read 7-10 % low on an H200 (RESULTS v16). The bench also measures after its runs and
    keeps the best of both."""
    copies, reads = [copy_bandwidth(device) for _ in range(tries)], [read_bandwidth(device) for _ in range(tries)]
    return max(copies) if copies[0] else None, max(reads) if reads[0] else None


def floors(moved: int, copy: float | None, read: float | None) -> dict[str, float]:
    """ms to move `moved` bytes at the datasheet bandwidth and, where measured, at the copy and the read
    kernels' (in that order: the last is the tightest floor)."""
    out = {"spec": 1e3 * moved / SPEC_BANDWIDTH}
    for name, bandwidth in (("measured_copy", copy), ("measured_read", read)):
        if bandwidth:
            out[name] = 1e3 * moved / bandwidth
    return out


def describe(params: SamplingParams) -> str:
    """The decoding the runs used, in words: "greedy" or "sampled at temperature 0.8, top-p 0.95, seed 0",
    then any penalties and logprobs ("greedy, presence penalty 0.5, logprobs 5")."""
    extras = [f"presence penalty {params.presence_penalty:g}"] if params.presence_penalty else []
    extras += [f"frequency penalty {params.frequency_penalty:g}"] if params.frequency_penalty else []
    extras += [f"repetition penalty {params.repetition_penalty:g}"] if params.repetition_penalty != 1 else []
    extras += [f"logprobs {params.logprobs}"] if params.logprobs is not None else []
    if params.greedy:
        return ", ".join(["greedy", *extras])
    parts = [f"temperature {params.temperature:g}"]
    parts += [f"top-k {params.top_k}"] if params.top_k > 0 else []
    parts += [f"top-p {params.top_p:g}"] if params.top_p < 1 else []
    parts += [f"min-p {params.min_p:g}"] if params.min_p > 0 else []
    parts += [f"seed {params.seed}"] if params.seed is not None else []
    return "sampled at " + ", ".join(parts + extras)


def paths_to_run(asked: list[str], engine: Engine) -> list[str]:
    """The asked paths, less `fast` when the target has none (said on stderr): an error if none is left."""
    if engine.fast is not None or "fast" not in asked:
        return asked
    reason, eager = engine.fast_unsupported, [p for p in asked if p != "fast"]
    if not eager:
        raise DDTreeError(f"no fast path for this target ({reason}); use --paths eager")
    log(f"fast path declined ({reason}): running the eager path only")
    return eager


def prefix_match(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each output that equals the reference before the first difference (1.0: identical).

    Greedy decoding is identical in exact arithmetic; in bf16, batching a tree changes rounding, and a
    near-tie in the target's logits can then flip one argmax, after which the continuations part.
    """
    shares = []
    for out, ref in zip(outputs, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
        shares.append(same / max(len(ref), 1))
    return sum(shares) / len(shares)


def table(report: dict) -> str:
    def floor(key: str) -> str:
        return ", ".join(f"{v:.2f} ms ({k})" for k, v in report[key].items())

    lines = [f"{report['model']} ({report['dtype']}) on {report['device']}, torch {report['torch']}: "
             f"{report['prompts']} prompts x "
             f"{report['prompt_tokens']} tokens, {report['max_new_tokens']} new, {report['sampling']}. "
             f"One target step moves {report['step_bytes'] / 1e9:.2f} GB: floor {floor('floor_ms')}. "
             f"A speculative round (the step, the draft's block pass and its commit) moves "
             f"{report['round_bytes'] / 1e9:.2f} GB: floor {floor('round_floor_ms')}; the draft's share of it, "
             f"{100 * report['draft_share_of_round_floor']:.0f}%, is the least non-verify share a round at the "
             f"floor has. round/floor: against the {report['round_vs_floor_at']} floor"
             + (f". The draft scores {report['draft_vocab']} tokens (--draft-vocab)" if report["draft_vocab"]
                and report["draft_vocab"] < report["vocab_size"] else "")
             + (f". The draft runs in {report['draft_quantization']} (--draft-quantization)"
                if report.get("draft_quantization") else ""),
             *([f"fast path {report['fast_path']}"] if report["fast_path"] != "available" else []),
             "", "| path | method | B | tau | TPOT ms | tok/s | round ms | round/floor | round/AR | verify/AR | "
             "draft | tree | verify | commit | host | non-verify | == ar |", "|" + "---|" * 17]
    for r in report["results"]:
        p = r["phase_ms"]
        path = r["path"] + ("" if r["path"] == "eager" or r["on_fast_path"] else " (declined: reference)")
        lines.append(f"| {path} | {r['method']} | {r['budget'] or '-'} | {r['tau']:.2f} | {r['tpot_ms']:.2f} | "
                     f"{r['tokens_per_second']:.1f} | {r['round_ms']:.2f} | {r['round_vs_floor']:.2f} | "
                     f"{_ratio(r['round_vs_ar_step'])} | "
                     f"{_ratio(r['verify_vs_ar_step'])} | "
                     + " | ".join(f"{p.get(k, 0.0):.2f}" for k in ("draft", "tree", "verify", "commit", "host"))
                     + f" | {100 * r['non_verify_share']:.0f}% | {_same(r)} |")
    if "fast_vs_eager_ar_prefix_match" in report:
        lines.append(f"\nfast ar vs eager ar: {100 * report['fast_vs_eager_ar_prefix_match']:.0f}% common prefix")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _same(r: dict) -> str:
    if r["lossless"] is None:
        return "-"
    return "yes" if r["lossless"] else f"{100 * r['prefix_match']:.0f}% prefix"
