"""Target adapter: one transformers causal LM forward over a prefix + tree, with tapped hidden states.

The target is an ordinary `AutoModelForCausalLM` (Qwen3, Llama, Qwen3-MoE, ...). A verify pass feeds the
tree's tokens with explicit positions (siblings share one) and a 4-D additive mask in which every node
sees the committed prefix, its ancestors and itself. Tap features (outputs of the decoder layers the
drafter was trained on) are captured with forward hooks.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from ddtree.core.tree import DraftTree, visibility
from ddtree.errors import DDTreeError
from ddtree.kernels.invariant import where_fp8
from ddtree.models.checkpoint import check_checkpoint
from ddtree.models.draft import TargetShape, is_draft_dir
from ddtree.models.fp8_target import check_config, load_fp8_weights, quantize_target
from ddtree.models.hybrid import AttentionKV, HybridCache, TreeGDN, is_hybrid_config
from ddtree.models.quantize import check_device, check_format


class Target:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.config = model.config
        self.layers = model.model.layers
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._tap_ids: tuple[int, ...] = ()
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        # transformers renamed `past_key_values` to `cache` (5.2x); accept both generations.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.layer_types: list[str] = list(getattr(self.config, "layer_types", None) or ["full_attention"])
        self.sliding_window: int | None = getattr(self.config, "sliding_window", None)
        self.quantization: str | None = None  # how its projections are stored, when not in its dtype (load_target)

    @property
    def shape(self) -> TargetShape:
        return TargetShape(hidden_size=self.config.hidden_size, vocab_size=self.embed_tokens.num_embeddings,
                           num_layers=len(self.layers))

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 32768)

    def set_taps(self, layer_ids: tuple[int, ...]) -> None:
        """Capture the outputs of these decoder layers on every forward (concatenated in this order)."""
        for hook in self._hooks:
            hook.remove()
        self._tap_ids = tuple(layer_ids)
        self._hooks = [self.layers[t].register_forward_hook(self._capture(t)) for t in sorted(set(layer_ids))]

    def _capture(self, layer_id: int):
        def hook(_module, _args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def new_cache(self) -> DynamicCache:
        # One full-length cache layer per decoder layer, also for sliding-window models: windows are
        # applied by the masks, and compaction then works the same on every layer.
        return DynamicCache()

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        tree: DraftTree | None = None,
        logits_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ids [N] at positions [N] after the cached prefix; returns (logits [N', V], taps [N, k*H]).

        With a `tree` (ids = root + its nodes), each row sees the prefix, its ancestors and itself;
        without one the rows are a causal chain (the prompt, or a lone root). logits_rows keeps only
        the last rows' logits.
        """
        mask = None
        if tree is not None and tree.size:
            mask = self._masks(visibility(tree), cache.get_seq_length(), positions)
        self._captured.clear()
        # an fp8 target on the CPU: every row's products and attention get the same bits at any row count, as an
        # e4m3 rounding of the next projection's input would follow an ulp (kernels/invariant.py)
        with where_fp8(self.device, self.quantization):
            out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                             use_cache=True, logits_to_keep=logits_rows or 0, **{self._cache_kwarg: cache})
        taps = None
        if self._tap_ids:
            taps = torch.cat([self._captured[t][0] for t in self._tap_ids], dim=-1)
            self._captured.clear()
        return out.logits[0], taps

    def _masks(self, vis: torch.Tensor, past: int, positions: torch.Tensor) -> torch.Tensor | dict:
        """Additive [1, 1, N, past + N] mask(s): the whole prefix plus the tree's visibility block.

        One mask per layer type when the model mixes them (sliding windows, recurrent layers).
        """
        n = vis.shape[0]
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=self.device)
        allowed[:, past:] = vis.to(self.device)
        full = self._additive(allowed)
        if set(self.layer_types) == {"full_attention"}:
            return full
        masks: dict[str, torch.Tensor | None] = {"full_attention": full, "linear_attention": None}
        if "sliding_attention" in self.layer_types:
            key_pos = torch.cat([torch.arange(past, device=self.device), positions.to(self.device)])
            in_window = positions.to(self.device)[:, None] - key_pos[None, :] < self.sliding_window
            masks["sliding_attention"] = self._additive(allowed & in_window)
        return masks

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[None, None]

    @torch.inference_mode()
    def compact(self, cache: DynamicCache, past: int, keep: list[int]) -> None:
        """Keep only the tree rows `keep` (node indices, ascending, keep[0] = 0) after `past` committed rows."""
        n = len(keep)
        contiguous = keep == list(range(n))
        for layer in cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue  # a layer without K/V (recurrent, or not yet used)
            if not contiguous:
                idx = torch.tensor(keep, device=layer.keys.device) + past
                layer.keys[:, :, past:past + n] = layer.keys[:, :, idx]
                layer.values[:, :, past:past + n] = layer.values[:, :, idx]
            layer.keys = layer.keys[:, :, :past + n]
            layer.values = layer.values[:, :, :past + n]


class HybridTarget(Target):
    """A target with Gated DeltaNet layers: recurrent layers verify the tree depth by depth (hybrid.py)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.gdn = TreeGDN(model, self.device)
        self.first_attention_layer = self.layer_types.index("full_attention")

    def new_cache(self) -> HybridCache:
        return HybridCache(AttentionKV(self.first_attention_layer))

    def forward(self, ids, positions, cache: HybridCache, tree: DraftTree | None = None, logits_rows=None):
        self.gdn.run(cache, tree.parents if tree is not None and tree.size else None)
        return super().forward(ids, positions, cache.kv, tree, logits_rows)

    def compact(self, cache: HybridCache, past: int, keep: list[int]) -> None:
        super().compact(cache.kv, past, keep)
        TreeGDN.commit(cache, keep[-1])


def load_target(path: str | Path, *, device: torch.device, dtype: torch.dtype,
                quantization: str | None = None) -> Target:
    """Load a transformers causal LM checkpoint as a target; one-line errors for what is not one.

    Multimodal Qwen3.5/3.6 checkpoints load text-only, from their text config. A published FP8 checkpoint keeps
    its fp8 weights and block scales; `quantization` "fp8" quantizes a bf16 one on load (models/fp8_target.py).
    """
    d = Path(path)
    if not d.is_dir():
        raise DDTreeError(f"target directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise DDTreeError(f"target directory {d} has no config.json")
    if is_draft_dir(d):
        raise DDTreeError(f"{d} is a DFlash draft, not a target model (pass it as --draft)")
    try:
        config = AutoConfig.from_pretrained(d)
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise DDTreeError(f"cannot read the target config in {d}: {str(exc).splitlines()[0]}") from None
    text_config = config.get_text_config()
    quantized = next((c.quantization_config for c in (config, text_config)
                      if getattr(c, "quantization_config", None)), None)
    block = check_config(quantized if isinstance(quantized, dict) else getattr(quantized, "to_dict", dict)(), d)
    quantization = check_format(quantization, "target quantization")
    if block or quantization:
        check_device(device, "an fp8 target")
    for c in (config, text_config):  # the fp8 weights are ours to load: transformers casts them, unscaled
        if hasattr(c, "quantization_config"):
            del c.quantization_config
    check_checkpoint(d, quantized=quantized is not None)  # a damaged file fails in one line, not in the loader
    # an FP8 checkpoint's scales are no parameters of the model: transformers' report of them as unexpected goes
    report = logging.getLogger("transformers.modeling_utils")
    level = report.level
    report.setLevel(logging.ERROR if block else level)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(d, config=text_config, dtype=dtype,
                                                           attn_implementation="sdpa", output_loading_info=True)
    except (OSError, ValueError) as exc:
        raise DDTreeError(f"cannot load the target in {d}: {str(exc).splitlines()[0]}") from None
    finally:
        report.setLevel(level)
    tied = getattr(text_config, "tie_word_embeddings", False)
    missing = sorted(k for k in info.get("missing_keys", ()) if not (tied and k == "lm_head.weight"))
    if missing:
        raise DDTreeError(f"{d}: the checkpoint lacks {len(missing)} weight(s) of {type(model).__name__}, "
                          f"e.g. {missing[0]}")
    if not hasattr(getattr(model, "model", None), "layers"):
        raise DDTreeError(f"{d}: unsupported target architecture {type(model).__name__} (no decoder layers)")
    if block:
        load_fp8_weights(model, d, block)
    elif quantization:
        quantize_target(model, device)
    model = model.to(device)
    target = HybridTarget(model) if is_hybrid_config(text_config) else Target(model)
    if block:
        target.quantization = f"fp8 ({block[0]} x {block[1]} block scales, from the checkpoint)"
    elif quantization:
        target.quantization = "fp8 (per-channel scales, quantized on load)"
    return target
