"""A tree verify's projections (33-136 half-precision rows) on Hopper: our own wgmma GEMM (wgmma.cu).

cuBLASLt's nvjet kernels are the fastest library GEMMs at these rows, but they do not execute
griddepcontrol.wait, so they cannot launch as programmatic dependents: every
one of a B = 64 verify's 145 projections starts only after the kernel before it has drained, and the norm
or attention kernel after it waits for its tail. Triton pads 65 rows to 128 and turns compute-bound.
This kernel pads them to a multiple of 8 (the wgmma N side), streams the weight by TMA, and prefetches its
first tiles while the kernel before it drains. On the 8B shape, in one process, a B = 64 round took 5.71 ms
against 5.92 with cuBLASLt, a B = 32 round 5.42 against 5.68.

A SwiGLU MLP's gate/up product can take SiLU · up in its epilogue (`Config.glu`, `silu_mul_linear`): the kernel
writes the activation the down projection reads, with the row kernel's bits, so the row kernel between the two
GEMMs, one launch a layer, goes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.kernels import nvrtc
from ddtree.kernels.jit import pdl, sm_count
from ddtree.switches import SWITCHES

MIN_ROWS, MAX_ROWS = 33, 136  # the rows the kernel takes: past 256 wgmma has no N; past 136 untested
SHARED_BYTES = 227 * 1024  # an H100/H200 block's dynamic shared memory
SM_SHARED_BYTES = 228 * 1024  # an SM's, which also holds 1 KB for each resident block
BOXES = 2  # K boxes a stage holds (Config.boxes), where K allows
STAGE_LIMIT = 8  # the deepest ring launch_config gives
EARLY_STEPS = frozenset(("norm", "heads", "attention"))  # the steps that let the next kernel launch first (`early_pdl`)


@dataclass(frozen=True)
class Config:
    """Tile and grid of one product: `consumers` warpgroups of 64 weight rows each, `bn` padded rows, `stages`
    shared-memory stages, K split over `splits` blocks; `evict_first`: the weight's lines are the first L2 evicts;
    `glu`: the weight is a fused [gate; up], each block takes half its rows from each, and the kernel writes
    SiLU(gate) · up (the block's gate and up tiles meet in shared memory, which the stages must hold);
    `boxes`: 64-wide K boxes a stage holds side by side, so a block reads 128 * boxes contiguous bytes of each
    weight row at once (the products' order, so their bits, do not change)."""

    consumers: int
    bn: int
    stages: int
    splits: int
    evict_first: bool = False
    glu: bool = False
    boxes: int = 1

    def __post_init__(self) -> None:
        if self.glu and self.shared_bytes - 1024 < 2 * self.block_rows * self.bn:
            raise ValueError(f"{self}: the stages cannot hold the gate and up tiles")

    @property
    def block_rows(self) -> int:
        return 64 * self.consumers

    @property
    def shared_bytes(self) -> int:
        return self.stages * stage_bytes(self.consumers, self.bn, self.boxes) + 1024  # + slack to align the tiles

    @property
    def launch_shared_bytes(self) -> int:
        """The shared memory a block asks for: at least half an SM's, so that no SM ever runs two blocks. A launch
        whose blocks fill SMs as the kernel before them drains (a programmatic dependent) could otherwise pack two
        small blocks (8 stages of 40 rows) into each SM freed first and leave others idle."""
        return max(self.shared_bytes, SM_SHARED_BYTES // 2)


def padded_rows(rows: int) -> int:
    """The rows' tile: a multiple of 8, wgmma's N step."""
    return -(-rows // 8) * 8


def stage_bytes(consumers: int, bn: int, boxes: int = 1) -> int:
    """One stage's shared memory: each K box's 128-byte rows of the block's weight rows and of the padded rows."""
    return (64 * consumers + bn) * 128 * boxes


def max_stages(consumers: int, bn: int, boxes: int = 1) -> int:
    """As many stages as shared memory holds, up to STAGE_LIMIT (8: the deepest benchmarks/wgmma_tune.py tried)."""
    return min(STAGE_LIMIT, (SHARED_BYTES - 2048) // stage_bytes(consumers, bn, boxes))


MIN_FILL = 0.7  # the least share of the SMs a launch's waves keep busy for the kernel to take a product (`supported`)


@functools.cache
def launch_config(n: int, k: int, rows: int, sms: int = 132) -> Config:
    """The narrowest weight tile (1-3 warpgroups of 64 rows) whose blocks fit one wave of `sms`, then K splits
    while the blocks still do (each split at least 8 K tiles); the widest tile where none fits (an LM head).
    Stages of BOXES K boxes where each split's K tiles make whole stages, as deep as shared memory holds.

    From benchmarks/wgmma_tune.py on an H200 at 65 rows: narrow tiles and few splits won, e.g. q/k/v
    16.5 µs with 64-row tiles and no split against 19.0 with 192-row tiles over 4 splits, o (11.6 µs) and down
    with 64-row tiles over 2 splits; a split costs a float32 round trip of the partial tiles. The weight's lines
    are marked first to evict from L2, which the rows' tile, read by every block, is not: faster in 31 of the 34
    configs tried, most by 1-6 %. Two boxes a stage (256 contiguous bytes of each weight row, 6 stages of one
    warpgroup's tiles where one box allowed 8): q/k/v 16.0 µs against 16.7, o 12.8 against 13.5, down 29.9 against
    30.5; in one process a B = 64 round took 5.37-5.40 ms against 5.46-5.47.
    """
    bn, k_tiles = padded_rows(rows), k // 64
    consumers = next((c for c in (1, 2, 3) if -(-n // (64 * c)) <= sms), 3)
    blocks = -(-n // (64 * consumers))
    splits = 1
    while blocks * splits * 2 <= sms and k_tiles % (splits * 2) == 0 and k_tiles // (splits * 2) >= 8:
        splits *= 2
    boxes = BOXES if (k_tiles // splits) % BOXES == 0 else 1
    return Config(consumers, bn, max_stages(consumers, bn, boxes), splits, evict_first=True, boxes=boxes)


def early_pdl(device: torch.device, rows: int, step: str) -> int:
    """The PDL constant for a norm, heads or attention kernel (`step`) over `rows` rows: 2 (let the next kernel
    launch, then wait) where the next projection is this GEMM's (MIN_ROWS-MAX_ROWS rows), else pdl(device).

    A programmatic dependent launches once every program of the kernel before it has let it. This GEMM loads its
    first weight tiles before it waits, but after a norm it would launch only once the projection before the norm
    had finished. Letting the next kernel launch first chains the launches: the next projection's blocks land,
    and load, on each SM the one before leaves, while the norm still waits. Not before the few-row GEMM or the
    GEMV: their small blocks, landing beside a running kernel's, pack onto the SMs it frees first, which was
    slower. `EARLY_STEPS` names the steps that take it."""
    takes = SWITCHES.wgmma and MIN_ROWS <= rows <= MAX_ROWS
    return 2 if pdl(device) and step in EARLY_STEPS and takes else int(pdl(device))


def fill(config: Config, n: int, sms: int) -> float:
    """The share of the SMs that have a block, averaged over the launch's waves."""
    blocks = -(-n // config.block_rows) * config.splits
    return blocks / (-(-blocks // sms) * sms)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this product: 33-136 half-precision rows, K a multiple of 64, both operands
    row-major with 16-byte aligned rows, on a Hopper GPU (sm_90; wgmma is not in later architectures' base
    instruction sets), where its blocks keep at least MIN_FILL of the SMs busy. Below that cuBLASLt's split-K
    kernels were the faster: a Qwen3.6-27B-shaped hybrid's 5120-row projections make 80 blocks on 132 SMs, and
    its B = 64 round took 26.7 ms with every projection here against 25.8 with cuBLASLt; the 8B
    shape's projections fill 0.73-1.0."""
    if not (SWITCHES.wgmma and x.is_cuda and x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in nvrtc.TENSOR_MAP_TYPES and MIN_ROWS <= x.shape[0] <= MAX_ROWS
            and x.shape[1] == weight.shape[1] and x.shape[1] % 64 == 0
            and nvrtc.tma_compatible(x) and nvrtc.tma_compatible(weight)
            and torch.cuda.get_device_capability(x.device) == (9, 0)):
        return False
    sms = sm_count(x.device)
    return fill(launch_config(weight.shape[0], x.shape[1], x.shape[0], sms), weight.shape[0], sms) >= MIN_FILL


def linear(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k]^T -> [rows, n]; with `config.glu`, SiLU(gate) · up [rows, n / 2] of it, gate
    the weight's first n / 2 rows (`silu_mul_linear`)."""
    rows, k = x.shape
    n = weight.shape[0]
    if config is None:
        config = launch_config(n, k, rows, sm_count(x.device))
    split_boxes = k // 64 // config.splits  # each split's 64-wide K boxes
    if split_boxes % config.boxes:
        raise ValueError(f"{config}: each split's {split_boxes} K boxes do not make whole stages")
    kernel = _kernel(config, x.dtype, x.device.index or 0)
    width = n // 2 if config.glu else n
    # the weight rows one TMA load brings, and the columns of `out` a block writes
    box = config.block_rows // 2 if config.glu else config.block_rows
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    tiles = -(-width // box)
    # an unsplit launch (SPLITS == 1) writes its tiles straight to `out` and never touches the workspace
    split = config.splits > 1
    partials, tickets = _workspace(x.device, split * tiles * config.splits * config.block_rows * config.bn,
                                   split * tiles)
    with torch.cuda.device(x.device):  # the module's context and the stream of x's device
        kernel.launch((tiles, config.splits, 1), 128 * (config.consumers + 1),
                      [_weight_map(weight, box), nvrtc.tensor_map(x, config.bn, 64),
                       ctypes.c_void_p(out.data_ptr()), ctypes.c_int(rows), ctypes.c_int(n),
                       ctypes.c_int(split_boxes // config.boxes), ctypes.c_void_p(partials.data_ptr()),
                       ctypes.c_void_p(tickets.data_ptr())], dependent=pdl(x.device))
    return out


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fused.silu_mul(linear(x, weight)) for a SwiGLU's fused [gate; up] weight [2I, k], SiLU · up in the
    product's epilogue (the caller checks `supported`): the tiles `linear` would take, each block's half of gate
    rows and half of the matching up rows."""
    if weight.shape[0] % 2:
        raise ValueError(f"a fused gate/up weight has an even number of rows, not {weight.shape[0]}")
    sms = sm_count(x.device)
    config = dataclasses.replace(launch_config(weight.shape[0], x.shape[1], x.shape[0], sms), glu=True)
    return linear(x, weight, config)


def source(config: Config, dtype: torch.dtype) -> str:
    """wgmma.cu with its tile sizes and the wgmma call for `config.bn` columns in front."""
    element = "bf16" if dtype == torch.bfloat16 else "f16"
    regs = config.bn // 2
    outputs = ", ".join(f"%{j}" for j in range(regs))
    operands = ", ".join(f'"+f"(d[{j}])' for j in range(regs))
    mma = (
        f"__device__ __forceinline__ void mma_tile(float (&d)[{regs}], unsigned long long a, unsigned long long b) {{\n"
        f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"\n'
        f'        "wgmma.mma_async.sync.aligned.m64n{config.bn}k16.f32.{element}.{element} '
        f'{{{outputs}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
        f'        : {operands}\n'
        f'        : "l"(a), "l"(b), "r"(1));\n}}\n')
    head = (f"#define CONSUMERS {config.consumers}\n#define BN {config.bn}\n#define STAGES {config.stages}\n"
            f'#define SPLITS {config.splits}\n#define EVICT_FIRST {int(config.evict_first)}\n'
            f'#define GLU {int(config.glu)}\n#define BOXES {config.boxes}\n'
            f'#define ELEMENT "{element}"\n')
    return head + mma + Path(__file__).with_name("wgmma.cu").read_text()


def compile_options() -> list[str]:
    """NVRTC's options: wgmma needs the architecture-specific sm_90a target."""
    return ["--gpu-architecture=sm_90a", "-std=c++17", "--use_fast_math", "-default-device"]


@functools.cache
def cubin(config: Config, dtype: torch.dtype) -> bytes:
    """The kernel for one config, built once per process (0.1-0.4 s each on a CPU)."""
    return nvrtc.compile_cubin(source(config, dtype), "wgmma.cu", compile_options())


@functools.cache
def _kernel(config: Config, dtype: torch.dtype, device: int) -> nvrtc.Kernel:
    """The kernel loaded into a device's context, once."""
    with torch.cuda.device(device):
        return nvrtc.Kernel(cubin(config, dtype), "wgmma_linear", config.launch_shared_bytes)


_WEIGHT_MAPS: dict[tuple[int, ...], nvrtc.TensorMap] = {}


def _weight_map(weight: torch.Tensor, block_rows: int) -> nvrtc.TensorMap:
    """A weight's descriptor, made once: weights do not move."""
    key = (weight.data_ptr(), *weight.shape, weight.stride(0), block_rows)
    if key not in _WEIGHT_MAPS:
        _WEIGHT_MAPS[key] = nvrtc.tensor_map(weight, block_rows, 64)
    return _WEIGHT_MAPS[key]


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[torch.Tensor] = []  # workspaces replaced by larger ones: graphs captured earlier still use them


def _workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split K's float32 partials and per-tile tickets, shared by every call on a device: the fast path queues
    its steps (warm-ups, captures, replays) on one timeline, where each call waits for the one before, and the
    last block of a tile leaves its ticket at 0. Two streams running these GEMMs at once would race here."""
    partials, tickets = _WORKSPACES.get(device, (None, None))
    if partials is None or partials.numel() < floats or tickets.numel() < tiles:
        if partials is not None:
            _OUTGROWN.extend((partials, tickets))
        partials = torch.empty(max(floats, 1 << 22), dtype=torch.float32, device=device)
        tickets = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _WORKSPACES[device] = (partials, tickets)
    return partials, tickets
