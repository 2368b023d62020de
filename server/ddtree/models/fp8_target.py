"""FP8 targets: Qwen's published FP8 checkpoints, and a bf16 target quantized to fp8 on load.

At batch 1 a decode step reads every weight once, so fp8 weights halve a round's bytes (Qwen3.6-27B: 51.6 GB
a step in bf16) and fit a 27B target with its drafter on a 48 GB GPU. Two ways in, each with its own activation
scheme (fp8.activation_group):

- A published FP8 checkpoint (Qwen3-8B-FP8, Qwen3-30B-A3B-FP8, Qwen3.5/3.6 ...-FP8): e4m3 weights with one
  float32 `weight_scale_inv` per 128 x 128 block, `quantization_config: {quant_method: fp8, fmt: e4m3,
  activation_scheme: dynamic, weight_block_size: [128, 128]}`. The blocks are kept as published (requantizing
  them per channel would change the model), and the rows are quantized per token per 128 columns (one scale per
  1 x 128 group), as transformers' fine-grained FP8 and vLLM's W8A8 block FP8 run these checkpoints (the model
  was evaluated so): each 128-wide K step's product is scaled by its rows' group scales and its block's scale
  (ddtree/kernels/gemm.py). Any other quantization format is refused by name, in one line.
- `--quantization fp8` on a bf16 checkpoint: every decoder projection quantized per output channel (the drafter's
  format, ddtree/models/quantize.py), the rows per token (one scale per row): vLLM's FP8-dynamic scheme. A channel
  scale and a row scale apply once after the whole sum, so the kernel takes the tuned 256-wide K steps and adds no
  multiply per step, and a channel's 128 x K values share one scale where a 128 x 128 block's 16 384 values share
  one.

Either way the embeddings, the LM head, the norms, the routers (`mlp.gate`, `shared_expert_gate`) and Gated
DeltaNet's tiny b/a projections stay in the model's dtype, as in Qwen's own FP8 checkpoints. Mixture-of-experts
weights become `Fp8Experts` (the reference path's experts; the fast path's expert kernels take their stacked
weights, ddtree/kernels/moe.py). The output stays lossless in the speculative sense: `ddtree` emits exactly the
FP8 target's own picks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ddtree.errors import DDTreeError
from ddtree.kernels.fp8 import SCALE_BLOCK, Fp8Weight, expand_rows, quantize_blocks, quantize_weight
from ddtree.kernels.gemm import fp8_linear
from ddtree.models.checkpoint import weight_files
from ddtree.models.quantize import Fp8Linear

# Projections that stay in the model's dtype when quantizing on load: the routers and Gated DeltaNet's b/a (a few
# rows each, which Qwen's FP8 checkpoints keep in bf16 too), besides the LM head and embeddings (not in layers).
KEPT = re.compile(r"(^|\.)(gate|shared_expert_gate|in_proj_a|in_proj_b|in_proj_ba)$")
SCALE_SUFFIX = ".weight_scale_inv"
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
# checkpoint prefixes of a multimodal Qwen3.5/3.6's text model -> the text model's own names
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))


def check_config(quantization: dict | None, where: Path) -> tuple[int, int] | None:
    """The weight block of a checkpoint's quantization_config (None for none), or a one-line error naming what
    ddtree does not implement."""
    if not quantization:
        return None
    method = quantization.get("quant_method")
    implemented = ("ddtree loads FP8 checkpoints with 128 x 128 block scales, or quantizes a bf16 one "
                   "(--quantization fp8)")
    if method != "fp8":
        raise DDTreeError(f"{where}: quantization method {method!r} is not implemented ({implemented})")
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise DDTreeError(f"{where}: fp8 format {fmt!r} is not implemented ({implemented}: e4m3)")
    activations = quantization.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise DDTreeError(f"{where}: fp8 activation scheme {activations!r} is not implemented ({implemented}, "
                          "activations scaled on the fly)")
    block = quantization.get("weight_block_size")
    if block is None:
        raise DDTreeError(f"{where}: per-tensor fp8 (no weight_block_size) is not implemented ({implemented})")
    if list(block) != [SCALE_BLOCK, SCALE_BLOCK]:
        raise DDTreeError(f"{where}: fp8 weight blocks {list(block)} are not implemented ({implemented})")
    return SCALE_BLOCK, SCALE_BLOCK


class Fp8Experts(nn.Module):
    """A mixture-of-experts block's stacked experts in fp8: gate/up [E, 2I, H] and down [E, H, I] values with
    their scales; computes what transformers' expert loop computes, each product through `fp8_linear`."""

    def __init__(self, gate_up: list[Fp8Weight], down: list[Fp8Weight], act: nn.Module) -> None:
        super().__init__()
        self.num_experts = len(gate_up)
        # gate/up's rows keep their own K-block scales where gate's do not end on a block (join_rows); down's not
        self.gate_up_block, self.down_block = gate_up[0].block, down[0].block
        self.register_buffer("gate_up", torch.stack([w.data for w in gate_up]), persistent=False)
        self.register_buffer("gate_up_scale", torch.stack([w.scale for w in gate_up]), persistent=False)
        self.register_buffer("down", torch.stack([w.data for w in down]), persistent=False)
        self.register_buffer("down_scale", torch.stack([w.scale for w in down]), persistent=False)
        self.act_fn = act

    @classmethod
    def quantized(cls, experts: nn.Module, device: torch.device, quantize: Callable) -> Fp8Experts:
        """transformers' stacked experts (gate_up_proj, down_proj), each expert's weights through `quantize`."""
        gate_up = [quantize(w.to(device)) for w in experts.gate_up_proj.detach()]
        down = [quantize(w.to(device)) for w in experts.down_proj.detach()]
        return cls(gate_up, down, experts.act_fn)

    def stacked(self) -> tuple[Fp8Weight, Fp8Weight]:
        """Every expert's gate/up and down weights, stacked (the fast path's expert kernels read them so)."""
        return (Fp8Weight(self.gate_up, self.gate_up_scale, self.gate_up_block),
                Fp8Weight(self.down, self.down_scale, self.down_block))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        gate_ups, downs = self.stacked()
        for expert in top_k_index.unique().tolist():  # ascending ids, as transformers' loop adds them
            token, position = torch.where(top_k_index == expert)
            gate_up, down = gate_ups[expert], downs[expert]
            gate, up = fp8_linear(hidden_states[token], gate_up).chunk(2, dim=-1)
            y = fp8_linear(self.act_fn(gate) * up, down) * top_k_weights[token, position, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def quantize_target(model: nn.Module, device: torch.device, blocks: bool = False) -> int:
    """`--quantization fp8`: every projection of the decoder layers (bar KEPT) as an Fp8Linear quantized per
    channel, and stacked experts as Fp8Experts, each weight moved to `device` first (the GPU holds the fp8 model
    and one bf16 weight at a time). `blocks`: in the published 128 x 128 blocks instead (a benchmark's random
    weights in the checkpoints' format). Returns how many weights were quantized."""
    quantize = quantize_blocks if blocks else quantize_weight
    count = 0
    for name, module in list(model.model.layers.named_modules()):
        parent, _, attr = name.rpartition(".")
        owner = model.model.layers.get_submodule(parent) if parent else model.model.layers
        if type(module) is nn.Linear and not KEPT.search(name):
            if module.bias is not None:
                raise DDTreeError(f"fp8 quantization takes bias-free projections only ({name} has a bias)")
            setattr(owner, attr, Fp8Linear(quantize(module.weight.detach().to(device))))
            count += 1
        elif getattr(module, "gate_up_proj", None) is not None and getattr(module, "down_proj", None) is not None:
            setattr(owner, attr, Fp8Experts.quantized(module, device, quantize))
            count += 2 * module.gate_up_proj.shape[0]
    return count


def stored_bytes(module: nn.Module) -> int:
    """Bytes a module's weights take: its parameters, and its fp8 projections' values and scales (buffers)."""
    fp8 = [b for m in module.modules() if isinstance(m, (Fp8Linear, Fp8Experts)) for b in m.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *fp8])


def load_fp8_weights(model: nn.Module, directory: Path, block: tuple[int, int]) -> int:
    """Replace the projections an FP8 checkpoint stores in fp8 (each `X.weight` with its `X.weight_scale_inv`) by
    Fp8Linear (or, for per-expert weights, Fp8Experts) holding the checkpoint's own values and block scales; the
    model was loaded with those weights cast to its dtype, unscaled, which this discards. Returns the count."""
    experts: dict[str, dict[int, dict[str, Fp8Weight]]] = {}
    count = 0
    for path in weight_files(directory):
        with safe_open(path, framework="pt") as f:
            names = f.keys()
            for key in names:
                if not key.endswith(SCALE_SUFFIX):
                    continue
                name = _text_name(key[:-len(SCALE_SUFFIX)])
                data = f.get_tensor(f"{key[:-len(SCALE_SUFFIX)]}.weight")
                if data.dtype != torch.float8_e4m3fn:
                    raise DDTreeError(f"{path}: {name}.weight is {data.dtype}, not float8_e4m3fn, beside its scales")
                weight = Fp8Weight(data, f.get_tensor(key).float(), block)
                _check_scales(weight, name, path)
                count += 1
                if match := EXPERT.match(name):
                    experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = weight
                    continue
                try:
                    module = model.get_submodule(name)
                except AttributeError:
                    raise DDTreeError(f"{path}: fp8 weight {name} matches no projection of the model") from None
                if type(module) is not nn.Linear or module.bias is not None:
                    raise DDTreeError(f"{path}: fp8 weight {name} is not a bias-free linear projection")
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, Fp8Linear(weight))
    for name, by_expert in experts.items():
        module = model.get_submodule(name)
        gate_up, down = [], []
        for e in range(module.num_experts):
            parts = by_expert.get(e, {})
            if set(parts) != {"gate_proj", "up_proj", "down_proj"}:
                raise DDTreeError(f"{directory}: expert {e} of {name} lacks fp8 weights (it has {sorted(parts)})")
            gate_up.append(join_rows([parts["gate_proj"], parts["up_proj"]]))
            down.append(parts["down_proj"])
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Fp8Experts(gate_up, down, module.act_fn))
    return count


def join_rows(weights: list[Fp8Weight]) -> Fp8Weight:
    """Weights stacked along their rows (one projection whose outputs are theirs side by side): block scales stay
    blocks where every part but the last ends on a block, else each row keeps its own (`expand_rows`)."""
    if len({w.block for w in weights}) > 1:
        raise ValueError("weights with different scale formats cannot be joined")
    rows = weights[0].block[0] if weights[0].block else 1
    if any(w.shape[0] % rows for w in weights[:-1]):
        weights = [expand_rows(w) for w in weights]
    return Fp8Weight(torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]), weights[0].block)


def _check_scales(weight: Fp8Weight, name: str, path: Path) -> None:
    n, k = weight.shape
    rows, cols = weight.block
    want = (-(-n // rows), -(-k // cols))
    if tuple(weight.scale.shape) != want:
        raise DDTreeError(f"{path}: {name}.weight_scale_inv has shape {list(weight.scale.shape)}, not {list(want)} "
                          f"for a {n} x {k} weight in {rows} x {cols} blocks")


def _text_name(name: str) -> str:
    """A checkpoint tensor's module name in the text model transformers builds (multimodal prefixes dropped)."""
    for prefix, text in TEXT_PREFIXES:
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name
