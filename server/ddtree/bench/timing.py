"""Timing helpers the benchmarks share: CUDA-graph replay timings, the device's measured copy and read
bandwidth, and the bytes a step must move at least (its time floor)."""


from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no read-bandwidth kernel (read_bandwidth gives None)
    triton = None

from ddtree.engine import Engine
from ddtree.fast.layers import weight_of
from ddtree.kernels.fp8 import Fp8Weight
from ddtree.kernels.jit import OutOfResources, triton_works
from ddtree.models.fp8_target import stored_bytes
from ddtree.models.quantize import Fp8Linear

SPEC_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s (datasheet)


def weight_bytes(engine: Engine, context: int) -> int:
    """Bytes one batch-1 target step must move at least: its time floor at a given bandwidth (the sum of
    target_parts)."""
    return sum(target_parts(engine, context).values())


def target_parts(engine: Engine, context: int) -> dict[str, int]:
    """The bytes of weight_bytes by what reads them (`ddtree bench --profile` sets each against its kernels):

        weights  every parameter but the experts, less the input embedding unless tied to the LM head (a step
                 reads one row)
        experts  of a mixture-of-experts layer's experts only the k of E a token picks
        kv       2 x attention layers x kv_heads x head_dim x dtype bytes x context, the attention layers
                 being all but the linear-attention (Gated DeltaNet) ones
        state    2 x linear-attention layers x gdn_state_bytes: each layer's state is read and written once
    """
    model, cfg = engine.target.model, engine.target.config
    embed = engine.target.embed_tokens.weight
    size = embed.element_size()
    tied = engine.target.lm_head.weight.data_ptr() == embed.data_ptr()
    params = stored_bytes(model)  # fp8 projections with their scales
    experts = sum(stored_bytes(getattr(layer.mlp, "experts", nn.Module())) for layer in engine.target.layers)
    picked = experts * getattr(cfg, "num_experts_per_tok", 0) // getattr(cfg, "num_experts", 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    linear = engine.target.layer_types.count("linear_attention")
    kv = 2 * (cfg.num_hidden_layers - linear) * cfg.num_key_value_heads * head_dim * size * context
    state = 2 * linear * gdn_state_bytes(cfg, size) if linear else 0
    return dict(weights=params - experts - (0 if tied else embed.numel() * size), experts=picked, kv=kv, state=state)


def draft_bytes(engine: Engine, context: int) -> int:
    """Bytes a speculative round moves at least on top of the target step's (dflash and ddtree rounds): the sum
    of draft_parts."""
    return sum(draft_parts(engine, context).values())


def draft_parts(engine: Engine, context: int) -> dict[str, int]:
    """The bytes of draft_bytes by what reads them:

        weights  every draft weight: the block pass reads its layers, the commit its fc (fp8 ones with their
                 scales, for a quantized draft); the draft layers' K and V projections once more (the commit
                 projects the committed rows with them); and the LM head, the target's (or its rows of a draft
                 vocabulary, or their fp8 copy), which scores the block's rows
        kv       2 x draft layers x kv_heads x head_dim x dtype bytes x context (the draft's context cache)
    """
    draft, cfg = engine.draft, engine.draft.config
    fp8 = [m.fp8 for m in draft.modules() if isinstance(m, Fp8Linear)]
    again = sum(_weight_bytes(weight_of(m)) for layer in draft.layers
                for m in (layer.self_attn.k_proj, layer.self_attn.v_proj))
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * draft.norm.weight.element_size() * context
    weights = nbytes(draft.parameters()) + sum(w.nbytes for w in fp8)
    return dict(weights=weights + again + _weight_bytes(engine.draft_head.weight), kv=kv)


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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (host timers around GPU work need it; a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_ms(fn: Callable[[], object], reps: int = 15) -> float:
    """Median ms of one replay of `fn` captured as a CUDA graph (warmed up on a side stream first; the first
    replays are dropped)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
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


def cycled_us(fn: Callable[..., object], weights: list) -> float:
    """µs per call of fn(weight): CYCLED_CALLS calls cycling over `weights`, replayed as one CUDA graph."""
    def calls() -> None:
        for i in range(CYCLED_CALLS):
            fn(weights[i % len(weights)])
    return 1e3 * graph_ms(calls) / CYCLED_CALLS


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


READ_BLOCK = 8192  # elements per program: on an H200 4.62 TB/s, against 4.22 for torch.sum


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


def measured_ceilings(device: torch.device, tries: int = 3) -> tuple[float | None, float | None]:
    """(copy, read) bandwidth now, each the best of `tries`: right after the models were built, a first copy
    measurement has read 7-10 % low on an H200. The bench also measures after its runs and
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


