"""Tiny checkpoints in the real on-disk formats (random weights), built on the fly for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ddtree.models.dflash2 import SelectorConfig
from ddtree.models.draft import (
    DFlashDraft,
    TargetShape,
    default_taps,
    draft_config_dict,
    parse_draft_config,
    write_draft_checkpoint,
)
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

VOCAB = 96
HIDDEN = 64
MASK_ID = VOCAB - 1  # an unused embedding row, like Qwen3's <|MASK|> (vocab - 1 for other sizes)
EOS_ID = VOCAB - 2  # (vocab - 2 for other sizes)
SELECTOR = SelectorConfig(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def target_config(arch: str = "qwen3", *, vocab: int = VOCAB, layers: int = 4, sliding_window: int | None = None,
                  hidden: int = HIDDEN, head_dim: int = 16, moe_intermediate: int = 32, initializer_range: float = 0.2):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=vocab - 2, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                  initializer_range=initializer_range)
    if arch == "qwen3":
        extra = {}
        if sliding_window:
            extra = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0,
                         layer_types=["sliding_attention", "full_attention"] * (layers // 2))
        return Qwen3Config(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra,
                           **common)
    if arch == "llama":
        return LlamaConfig(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=head_dim, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[],
                              moe_intermediate_size=moe_intermediate, decoder_sparse_step=1, **common)
    raise ValueError(arch)


def make_target(out: Path, arch: str = "qwen3", seed: int = 0, generation_config: dict | None = None, **kw) -> Path:
    """A random target saved with save_pretrained (config.json + model.safetensors + generation config);
    `generation_config` adds keys to generation_config.json as written, e.g. Qwen3's sampling defaults (even
    ones transformers would refuse to save, as older checkpoints hold)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(arch, **kw), dtype=torch.float32)
    model.generation_config.eos_token_id = model.config.vocab_size - 2
    model.save_pretrained(out)
    if generation_config:
        path = Path(out) / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **generation_config}, indent=2))
    return out


def make_draft(out: Path, *, target_layers: int = 4, vocab: int = VOCAB, layers: int = 2, block_size: int = 8,
               seed: int = 1, layout: str = "old", sliding_window: int | None = None, taps=None,
               layer_types: list[str] | None = None, is_causal: bool | None = None, fields: dict | None = None,
               sinks: str | None = None, selector: SelectorConfig | None = None, hidden: int = HIDDEN) -> Path:
    """A random DFlash draft in the z-lab format; layout "old" (top-level block_size, rope_theta) or "new".

    A sliding window makes the first layer a sliding one (unless `layer_types` says otherwise); `is_causal` is
    written at the top level when given; `fields` go into dflash_config (input_embedding_scale, output_multiplier,
    final_logit_softcapping); `sinks` names per-layer sink logits ("sinks", or another exporter's
    "attention_sink_bias") and sets attention_sink_bias; a `selector` makes it a DFlash2 draft (its codebooks
    stored without `.weight`, as published)."""
    taps = list(taps) if taps is not None else default_taps(target_layers, 2)
    if layer_types is None and sliding_window:
        layer_types = ["sliding_attention"] + ["full_attention"] * (layers - 1)
    cfg = draft_config_dict(hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, vocab_size=vocab, block_size=block_size, mask_token_id=vocab - 1,
                            target_layer_ids=taps, num_target_layers=target_layers, max_position_embeddings=1024,
                            layer_types=layer_types, sliding_window=sliding_window, is_causal=is_causal,
                            selector=selector)
    cfg["dflash_config"].update(fields or {})
    if sinks:
        cfg["attention_sink_bias"] = True
    if layout == "new":
        cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        cfg.pop("rope_scaling")
    torch.manual_seed(seed)
    model = DFlashDraft(parse_draft_config(cfg, TargetShape(hidden, vocab, target_layers)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "base_kernel" in name:  # near the identity convolution, so that the block stream keeps its scale
                p.normal_(0.0, 0.15)[:, 0] += 1.0
            elif "kernel_projection" in name:
                p.normal_(0.0, 0.05)
            elif "codebook" in name or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
            elif "norm" not in name:
                p.normal_(0.0, 0.15)
    state = model.state_dict()
    if sinks and sinks != "sinks":
        state = {k.replace("self_attn.sinks", f"self_attn.{sinks}"): v for k, v in state.items()}
    write_draft_checkpoint(out, cfg, state, dtype=torch.float32)
    return out


def make_dflash2_draft(out: Path, *, sliding_window: int | None = 6, is_causal: bool | None = False,
                       selector: SelectorConfig = SELECTOR, **kw) -> Path:
    """A random DFlash2 draft shaped like the published ones (new layout, sliding layers, is_causal false)."""
    layers = kw.pop("layers", 2)
    kw.setdefault("layer_types", ["sliding_attention"] * layers if sliding_window else None)
    return make_draft(out, layout=kw.pop("layout", "new"), layers=layers, sliding_window=sliding_window,
                      is_causal=is_causal, selector=selector, **kw)


def hybrid_text_config(arch: str = "qwen3_5", *, vocab: int = VOCAB, layers: int = 4, hidden: int = HIDDEN) -> dict:
    """A tiny Qwen3.5-style stack: three Gated DeltaNet layers, then one gated full-attention layer (per 4 layers;
    fewer than 4: Gated DeltaNet layers, then one full-attention layer)."""
    if layers % 4:
        layer_types = ["linear_attention"] * (layers - 1) + ["full_attention"]
    else:
        layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    cfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               max_position_embeddings=1024, layer_types=layer_types, eos_token_id=vocab - 2,
               tie_word_embeddings=False, initializer_range=0.2)
    if arch in ("qwen3_5_moe", "qwen3_next"):
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if arch == "qwen3_next":
        cfg.update(partial_rotary_factor=0.25, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def make_hybrid_target(out: Path, arch: str = "qwen3_5", seed: int = 0, multimodal: bool = True,
                       hidden: int = HIDDEN, layers: int = 4) -> Path:
    """Qwen3.5 / Qwen3.5-MoE in the multimodal checkpoint layout (as published), or Qwen3-Next (text only)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    torch.manual_seed(seed)
    text = hybrid_text_config(arch, hidden=hidden, layers=layers)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden)
    if arch == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**text))
    elif arch == "qwen3_5":
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    else:
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))
    model.generation_config.eos_token_id = text["eos_token_id"]
    model.save_pretrained(out)
    return out


def prefill(target, tokens: list[int]):
    """A fresh target cache holding `tokens` (run as a causal chain)."""
    cache = target.new_cache()
    target.forward(torch.tensor(tokens), torch.arange(len(tokens)), cache)
    return cache


def path_tokens(tree, node: int) -> list[int]:
    """The draft tokens on the way from the root to `node`."""
    return [tree.tokens[n - 1] for n in tree.path_to(node)[1:]]


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def make_fp8_checkpoint(source: Path, out: Path) -> Path:
    """`source` (a tiny checkpoint) in Qwen's published FP8 format: each decoder projection (routers and Gated
    DeltaNet's b/a excepted, as Qwen keeps them) as e4m3 `weight` + float32 `weight_scale_inv` per 128 x 128 block,
    and the config's quantization_config; the other tensors and files as they were."""
    import shutil

    from ddtree.kernels.fp8 import quantize_blocks
    from ddtree.models.fp8_target import KEPT
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, out / path.name)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if tensor.dim() == 2 and name.endswith(".weight") and ".layers." in name and not KEPT.search(module):
            fp8 = quantize_blocks(tensor)
            tensors[name], tensors[f"{module}.weight_scale_inv"] = fp8.data, fp8.scale
        else:
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
