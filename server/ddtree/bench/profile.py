"""`ddtree bench --profile`: where a step's device time goes, by kind of layer, against the bytes it must read.

A few extra decode steps of each run go under torch.profiler (CUDA kernels on a GPU, CPU ops' self time
elsewhere). Each kernel is put in one kind by its name (classify): our Triton kernels by their exact names,
cuBLAS / flash-attention / torch kernels and torch.compile's fused kernels by what their names contain. The
table gives ms a step per kind and its share of the step (on a GPU, of the span its kernels cover: each kernel
charged what it adds to that span, and `idle` where none runs; see ms_by_kind); for the kinds whose floor is a byte
count (projections: their weights; attention: the KV the step's requests read; recurrent: each request's
state read and written once) also the bytes, the GB/s reached, and the time against the floor at the
device's bandwidth (timing.floors). A regression then shows as a kind whose ms or ratio grows, without a
profiler session.

Everything but `record`, `profile_batch` and `profile_single` is pure, so the classification and the tables
are tested without a GPU.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddtree.bench.timing import draft_parts, floors, target_parts
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.engine.batch import BatchEngine

KINDS = ("projections", "attention", "norms", "activations", "rotary", "recurrent", "moe", "sampling", "copies",
         "other", "idle")  # idle: on a device, the time between kernels with none running (waiting on the host)
FLOORED = {"projections": "weights", "attention": "KV read", "recurrent": "state r+w"}  # kind -> its bytes

# ddtree.kernels' own kernels (Triton functions and the wgmma CUDA kernel), by exact name
OURS = {
    **dict.fromkeys(("_skinny_kernel", "_gemv_kernel", "wgmma_linear"), "projections"),
    "_quantize_kernel": "projections",  # an fp8 GEMM's activation rows (with SiLU for a down projection)
    **dict.fromkeys(("_paged_kernel", "_split_kernel", "_merge_kernel"), "attention"),
    "_norm_kernel": "norms",
    "_silu_kernel": "activations",
    "_heads_kernel": "rotary",  # q/k norm + RoPE + head layout + KV write, one kernel
    **dict.fromkeys(("_row_kernel", "_commit_kernel", "_tree_prep_kernel", "_tree_delta_kernel",
                     "_varlen_prep_kernel", "_varlen_delta_kernel"), "recurrent"),
    **dict.fromkeys(("_route_kernel", "_up_kernel", "_down_kernel", "_combine_kernel"), "moe"),
    **dict.fromkeys(("_tree_kernel", "_chunk_top_kernel", "_chunk_argmax_kernel", "_chunk_sample_kernel",
                     "_merge_argmax_kernel", "_merge_top_kernel", "_selector_tree_kernel", "_selector_chain_kernel",
                     "_walk_kernel"), "sampling"),
    **dict.fromkeys(("_gather_kernel", "_copy_pages_kernel", "_compact_kernel"), "copies"),
}

# everyone else's kernels and CPU ops, by what their (lower-cased) names contain; the first match wins, so the
# specific come first (fmha_cutlass is attention, not a GEMM; gatherTopK is sampling, not a copy)
PATTERNS = [(kind, re.compile(pattern)) for kind, pattern in (
    ("recurrent", r"gated_delta|delta_rule|causal_conv1d|recurrent|gdn"),
    ("moe", r"moe|expert"),
    ("attention", r"attention|attn|flash|fmha|sdpa|paged"),
    ("sampling", r"topk|top_k|sort|argmax|argmin|softmax|logsumexp|multinomial|sampl|cumsum"),
    ("projections", r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitkreduce|matmul|^aten::(mm|addmm|bmm|baddbmm|linear)$"),
    ("rotary", r"rope|rotary"),
    ("norms", r"rms_?norm|layer_?norm|rowwisemoments|rsqrt"),
    ("activations", r"silu|gelu|swiglu|sigmoid|act_and_mul"),
    ("copies", r"copy|memcpy|memset|index_select|indexselect|index_elementwise|index_put|gather|scatter|fill"
               r"|embedding|^aten::(cat|stack|repeat|index|clone|contiguous|to|zero_|narrow_copy)$"),
)]

FUSED = re.compile(r"^triton_(poi|red|per|tem)_fused_(.*?)(_\d+)*$")  # torch.compile's kernels: ops in the name
MOVES = {"to", "copy", "clone", "cat", "index", "slice", "select", "view", "unsqueeze", "squeeze", "embedding",
         "gather", "scatter", "stack", "permute", "transpose", "expand", "new", "zeros", "full", "fill", "put"}


@functools.cache  # a profile has thousands of launches of a few dozen kernels
def classify(name: str) -> str | None:
    """The kind of layer a kernel or op belongs to, from its name; None when the name does not say (a plain
    add or multiply: its op's parents may, see kind_of)."""
    if name in OURS:
        return OURS[name]
    fused = FUSED.match(name)
    if fused:
        return _fused_kind(fused.group(1), {t for t in fused.group(2).split("_") if t})
    lowered = name.lower()
    return next((kind for kind, pattern in PATTERNS if pattern.search(lowered)), None)


def _fused_kind(template: str, ops: set[str]) -> str | None:
    """A torch.compile kernel's kind from the ops fused into it: a rotary embedding is cos/sin or cat with
    neg (rotate-half); a norm has rsqrt; an activation silu or sigmoid; data movement only moves."""
    if template == "tem" and ops & {"mm", "addmm", "bmm"}:
        return "projections"
    if ops & {"cos", "sin"} or {"cat", "neg"} <= ops:
        return "rotary"
    if "rsqrt" in ops:
        return "norms"
    if ops & {"silu", "sigmoid", "gelu", "tanh"}:
        return "activations"
    if ops & {"softmax", "amax", "argmax", "topk", "sort", "logsumexp"}:
        return "sampling"
    return "copies" if ops <= MOVES else None


@dataclass(frozen=True)
class Event:
    """One profiled kernel (or CPU op): its name, its own time, and for a CPU op the ops around it."""

    name: str
    us: float  # a kernel's duration, a CPU op's self time
    parents: tuple[str, ...] = ()  # the enclosing ops' names, outermost first
    start: float | None = None  # a kernel's start on the device's timeline, µs


def kind_of(event: Event) -> str:
    """The outermost classified name among the event's parents and itself: an `aten::mm` inside
    `aten::scaled_dot_product_attention` is attention, an `aten::copy_` inside `aten::linear` a projection."""
    return next((k for k in map(classify, (*event.parents, event.name)) if k), "other")


def ms_by_kind(events: Sequence[Event], steps: int) -> dict[str, float]:
    """ms a step of each kind (every kind, in KINDS order; 0.0 for those that did not run).

    Kernels on a timeline are charged what their end adds past every end before them, as
    benchmarks/timeline.py does: under programmatic dependent launch a kernel starts before the one it waits for
    ends, and summed durations would count that wait twice. The gaps with no kernel running are `idle`; the
    charges and the idle sum to the span from the first kernel's start to the last one's end. CPU ops (no
    timeline) are charged their self time."""
    us = dict.fromkeys(KINDS, 0.0)
    timed = sorted((e for e in events if e.start is not None), key=lambda e: e.start)
    latest = timed[0].start if timed else 0.0
    for event in timed:
        us["idle"] += max(0.0, event.start - latest)
        us[kind_of(event)] += max(0.0, event.start + event.us - max(latest, event.start))
        latest = max(latest, event.start + event.us)
    for event in events:
        if event.start is None:
            us[kind_of(event)] += event.us
    return {kind: value / 1e3 / max(steps, 1) for kind, value in us.items()}


@dataclass(frozen=True)
class Step:
    """One profiled step: its wall time, the requests it decoded and their context tokens (what attention reads)."""

    seconds: float
    sequences: int
    context_tokens: int


@dataclass(frozen=True)
class Sizes:
    """The bytes of a model a decode step must read at least, by what reads them (from timing's parts)."""

    weights: int  # the target's weights but the experts
    draft: int  # the draft's weights, its K/V projections again and its LM head: a speculative round's extra
    kv_token: int  # target K and V, one context token
    draft_kv_token: int  # the draft's context K and V, one token
    state: int  # a request's recurrent (Gated DeltaNet) state, read and written

    @classmethod
    def of(cls, engine: Engine) -> Sizes:
        target, draft = target_parts(engine, 1), draft_parts(engine, 1)
        return cls(target["weights"], draft["weights"], target["kv"], draft["kv"], target["state"])

    def moved(self, speculative: bool, step: Step) -> dict[str, int]:
        """Bytes a step reads per floored kind: weights once whatever the rows (the floor of batching), every
        decoded request's KV, every request's state."""
        kv = self.kv_token + (self.draft_kv_token if speculative else 0)
        return {"projections": self.weights + (self.draft if speculative else 0),
                "attention": kv * step.context_tokens, "recurrent": self.state * step.sequences}


def summarize(events: Sequence[Event], steps: Sequence[Step], sizes: Sizes, speculative: bool,
              ceilings: tuple[float | None, float | None], source: str) -> dict:
    """A run's profile: ms a step by kind and its share of their sum, the floored kinds' bytes, GB/s and
    time against the floor at the tightest bandwidth known (timing.floors: measured read, copy, else spec)."""
    n = max(len(steps), 1)
    ms = ms_by_kind(events, len(steps))
    total = sum(ms.values())
    moved: dict[str, float] = dict.fromkeys(FLOORED, 0.0)
    for step in steps:
        for kind, value in sizes.moved(speculative, step).items():
            moved[kind] += value / n
    terabyte = floors(10**12, *ceilings)  # ms at each bandwidth known, the tightest last
    floor_at = list(terabyte)[-1]
    bandwidth = 1e15 / terabyte[floor_at]  # bytes/s
    out_bytes, gb_per_s, vs_floor = {}, {}, {}
    for kind, value in moved.items():
        if value and ms[kind]:
            out_bytes[kind] = value
            gb_per_s[kind] = value / (ms[kind] / 1e3) / 1e9
            vs_floor[kind] = ms[kind] / (1e3 * value / bandwidth)
    return dict(source=source, steps=len(steps), step_ms=1e3 * sum(s.seconds for s in steps) / n,
                sequences=sum(s.sequences for s in steps) / n, total_ms=total, ms=ms,
                share={k: v / total if total else 0.0 for k, v in ms.items()}, bytes=out_bytes, gb_per_s=gb_per_s,
                vs_floor=vs_floor, floor_at=floor_at, floor_bandwidth=bandwidth)


def record(device: torch.device, step: Callable[[], Step | None], steps: int) -> tuple[list[Event], list[Step]]:
    """Up to `steps` calls of `step` (None: nothing left to run) under torch.profiler: the device's kernels on
    a GPU, the CPU ops otherwise."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    done: list[Step] = []
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        while len(done) < steps and (ran := step()) is not None:
            done.append(ran)
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        return [Event(e.name, e.time_range.elapsed_us(), start=e.time_range.start) for e in prof.events()
                if e.device_type == DeviceType.CUDA], done
    events = []
    for e in prof.events():
        if e.device_type == DeviceType.CPU and not e.is_async:
            parents, p = [], e.cpu_parent
            while p is not None:
                parents.append(p.name)
                p = p.cpu_parent
            events.append(Event(e.name, e.self_cpu_time_total, tuple(reversed(parents))))
    return events, done


def source_of(device: torch.device) -> str:
    return "CUDA kernels" if device.type == "cuda" else "CPU ops' self time"


def profile_batch(batch: BatchEngine, prompts: list[list[int]], params: SamplingParams, method: str,
                  budget: int | None, device: torch.device, sizes: Sizes,
                  ceilings: tuple[float | None, float | None], steps: int) -> dict:
    """Profile `steps` decode steps of `prompts` in flight together on `batch` (each prompt prefilled, its
    first token out, before the profile starts; the requests are aborted after it)."""
    seqs = [batch.add(ids, params, method=method, budget=budget) for ids in prompts]
    while batch.has_work() and not all(s.generation.token_ids for s in seqs):
        batch.step()

    def step() -> Step | None:
        running = [s for s in seqs if s.generation.finish_reason is None]
        if not running:
            return None
        context = sum(len(s.request.prompt_ids) + len(s.generation.token_ids) for s in running)
        started = time.perf_counter()
        batch.step()
        return Step(time.perf_counter() - started, batch.last.sequences, context)

    events, done = record(device, step, steps)
    for seq in seqs:
        batch.abort(seq)
    return summarize(events, done, sizes, method != "ar", ceilings, source_of(device))


def profile_single(engine: Engine, prompt: list[int], params: SamplingParams, method: str, budget: int,
                   device: torch.device, sizes: Sizes, ceilings: tuple[float | None, float | None],
                   steps: int) -> dict:
    """Profile `steps` rounds of one request on the single-request path (its prefill before the profile)."""
    gen = engine.stream(prompt, params, method=method, budget=budget)
    next(gen)  # the prefill

    def step() -> Step | None:
        if gen.finish_reason is not None:
            return None
        context = len(prompt) + len(gen.token_ids)
        started = time.perf_counter()
        next(gen)
        return Step(time.perf_counter() - started, 1, context)

    events, done = record(device, step, steps)
    gen.close()
    return summarize(events, done, sizes, method != "ar", ceilings, source_of(device))


def table(title: str, columns: list[tuple[str, dict]]) -> str:
    """One markdown table, a column per profiled run: ms a step by kind (share), the sum and the step's wall
    time, then for each floored kind its bytes, GB/s and time / floor."""
    first = columns[0][1]
    lines = [f"{title}: {first['source']}, ms a step by kind of layer (share of their sum); the bytes a step "
             f"must read, GB/s and time against the floor at the {first['floor_at']} bandwidth "
             f"({first['floor_bandwidth'] / 1e12:.2f} TB/s)",
             "", "| kind | " + " | ".join(label for label, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for kind in KINDS:
        lines.append(f"| {kind} | " + " | ".join(f"{p['ms'][kind]:.2f} ({100 * p['share'][kind]:.0f}%)"
                                                  for _, p in columns) + " |")
    lines.append("| sum | " + " | ".join(f"{p['total_ms']:.2f}" for _, p in columns) + " |")
    lines.append("| step (wall) | " + " | ".join(f"{p['step_ms']:.2f}" for _, p in columns) + " |")
    lines.append("| steps (requests) | " + " | ".join(f"{p['steps']} ({p['sequences']:.1f})" for _, p in columns)
                 + " |")
    for kind, what in FLOORED.items():
        if any(kind in p["bytes"] for _, p in columns):
            lines.append(f"| {kind}: {what} | " + " | ".join(_moved(p, kind) for _, p in columns) + " |")
    return "\n".join(lines)


def _moved(profile: dict, kind: str) -> str:
    if kind not in profile["bytes"]:
        return ""
    return (f"{_number(profile['bytes'][kind] / 1e6)} MB, {_number(profile['gb_per_s'][kind])} GB/s, "
            f"{_number(profile['vs_floor'][kind])}x floor")


def _number(value: float) -> str:
    """Three significant digits, without an exponent (a CPU's 0.273 GB/s beside a GPU's 3980)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def label(method: str, budget: int | None) -> str:
    return method + (f" B={budget}" if budget and method.startswith("ddtree") else "")


def concurrency_tables(rows: list[dict]) -> str:
    """The concurrency bench's profiles: one table per concurrency, a column per method."""
    levels = sorted({r["concurrency"] for r in rows if r.get("profile")})
    return "\n\n".join(table(f"profile at concurrency {c}", [(label(r["method"], r["budget"]), r["profile"])
                                                              for r in rows if r["concurrency"] == c and
                                                              r.get("profile")]) for c in levels)
