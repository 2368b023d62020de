"""The DFlash drafter: a small transformer that predicts a whole block in one pass (and DFlash2, which adds to it).

Our own module for the z-lab checkpoint format (config.json + model.safetensors, no remote code). It
owns no embedding and no LM head: block tokens are embedded by the target and its hidden states go
through the target's LM head. Context comes from target hidden states tapped at `target_layer_ids`,
projected by `fc` + `hidden_norm`, and injected as extra K/V rows in every layer.

Inside the block each layer is causal or bidirectional by the rule the serving engines and the current
reference share (dflash-checkpoint.md §4): a checkpoint's `is_causal` holds for every layer; without it,
`sliding_attention` layers are causal and `full_attention` layers bidirectional. The loader logs the rule it
applied to each layer: a drafter drafted under another rule than it was trained with stays lossless but
accepts less, which nothing else would show. A DFlash2 checkpoint (ddtree.models.dflash2) loads into the same
module, with its convolutions and its candidate selector.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from ddtree.core.tree import Transitions
from ddtree.errors import DDTreeError
from ddtree.models.checkpoint import check_checkpoint
from ddtree.models.dflash2 import CandidateSelector, DynamicConv, SelectorConfig, parse_selector_config

log = logging.getLogger("ddtree.draft")

REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# Tensor names other exporters give what we load under another name
ALIASES = {"candidate_selector.predecessor_codebook.weight": "candidate_selector.predecessor_codebook",
           "candidate_selector.successor_codebook.weight": "candidate_selector.successor_codebook",
           "self_attn.attention_sink_bias": "self_attn.sinks"}


@dataclass(frozen=True)
class TargetShape:
    """What a draft must agree with in its target."""

    hidden_size: int
    vocab_size: int  # rows of the target's input embedding
    num_layers: int


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_windows: tuple[int | None, ...]  # sliding window per layer (HF semantics), None = full attention
    layer_causal: tuple[bool, ...]  # per layer: block queries see only block keys at or before their own
    causality: str  # what decided layer_causal: "is_causal=true", "is_causal=false" or "layer types"
    rope_config: Qwen3Config  # carries rope_parameters for transformers' RoPE utilities
    input_embedding_scale: float = 1.0  # multiplies the target embeddings fed to the draft
    output_multiplier: float = 1.0  # multiplies the draft logits
    final_logit_softcapping: float = 0.0  # > 0: logits -> cap * tanh(logits / cap), after the multiplier
    attention_sinks: bool = False  # a learnable per-head sink logit in every layer (`self_attn.sinks`)
    selector: SelectorConfig | None = None  # DFlash2: the convolutions' and the candidate selector's fields

    @property
    def architecture(self) -> str:
        return "DFlash2DraftModel" if self.selector is not None else "DFlashDraftModel"

    @property
    def layer_rules(self) -> tuple[tuple[int | None, bool], ...]:
        """(window, causal) of each layer: what its block queries may see."""
        return tuple(zip(self.layer_windows, self.layer_causal, strict=True))

    def describe(self) -> str:
        """One line: the family and the causality rule applied to each layer, and why."""
        layers = ", ".join(f"{i}: {'causal' if causal else 'bidirectional'}"
                           + (f" window {window}" if window is not None else "")
                           for i, (window, causal) in enumerate(self.layer_rules))
        return f"{self.architecture}, block {self.block_size}, layers by {self.causality} ({layers})"


def default_taps(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's default tap layers: evenly spread from layer 1 to L-3."""
    if num_taps == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_taps - 1)) for i in range(num_taps)]


def is_draft_dir(path: str | Path) -> bool:
    """True when a directory holds a DFlash-family draft (which must not be loaded as a standalone model)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return False
    cfg = json.loads(cfg_path.read_text())
    return "dflash_config" in cfg or any("DFlash" in a for a in cfg.get("architectures") or [])


def parse_draft_config(
    raw: dict, target: TargetShape, where: str = "draft config", mask_token_from_tokenizer: int | None = None
) -> DraftConfig:
    """Resolve the z-lab config layouts (DFlash and DFlash2) and check the draft against its target; one-line
    errors."""
    archs = raw.get("architectures") or []
    if "dflash_config" not in raw and not any("DFlash" in a for a in archs):
        raise DDTreeError(f"{where}: not a DFlash draft (no dflash_config, architectures={archs})")
    missing = [f for f in REQUIRED_FIELDS if f not in raw]
    if missing:
        raise DDTreeError(f"{where}: missing required field(s) {', '.join(missing)}")
    dc = raw.get("dflash_config") or {}
    if dc.get("use_aux_hidden_state", True) is False:
        raise DDTreeError(f"{where}: drafts without auxiliary hidden states (use_aux_hidden_state=false) "
                          "are not supported")
    block_size = dc.get("block_size") or raw.get("block_size")
    if not block_size:
        raise DDTreeError(f"{where}: no block_size (top level or dflash_config)")
    if int(block_size) < 2:
        raise DDTreeError(f"{where}: block_size must be at least 2, got {block_size}")
    mask_id = dc.get("mask_token_id")
    if mask_id is None:
        mask_id = mask_token_from_tokenizer
    if mask_id is None:
        raise DDTreeError(f"{where}: no dflash_config.mask_token_id and the tokenizer has no "
                          f"{dc.get('mask_token', '<|MASK|>')} token")
    hidden = int(raw["hidden_size"])
    if hidden != target.hidden_size:
        raise DDTreeError(f"{where}: hidden_size {hidden} does not match the target's {target.hidden_size} "
                          "(this draft belongs to another target)")
    if int(raw["vocab_size"]) != target.vocab_size:
        raise DDTreeError(f"{where}: vocab_size {raw['vocab_size']} does not match the target's "
                          f"{target.vocab_size} (this draft belongs to another target)")
    selector = parse_selector_config(raw, hidden, target.vocab_size, where)
    n_target = int(raw.get("num_target_layers") or dc.get("num_target_layers") or target.num_layers)
    if n_target != target.num_layers:
        raise DDTreeError(f"{where}: trained for a {n_target}-layer target, but the target has "
                          f"{target.num_layers} layers")
    num_layers = int(raw["num_hidden_layers"])
    taps = dc.get("target_layer_ids") or dc.get("layer_ids") or default_taps(n_target, num_layers)
    bad = [t for t in taps if not 0 <= int(t) < n_target]
    if bad:
        raise DDTreeError(f"{where}: target_layer_ids {list(taps)} out of range for a {n_target}-layer target")
    if not 0 <= int(mask_id) < target.vocab_size:
        raise DDTreeError(f"{where}: mask_token_id {mask_id} is outside the target embedding "
                          f"({target.vocab_size} rows)")
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise DDTreeError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise DDTreeError(f"{where}: unknown layer type(s) {', '.join(unknown)}")
    window = raw.get("sliding_window")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in layer_types)
    is_causal = _flag(raw, dc, "is_causal", where)
    if is_causal is None:  # the 2026 rule: sliding layers causal inside the block, full-attention ones not
        causal, causality = tuple(t == "sliding_attention" for t in layer_types), "layer types (no is_causal)"
    else:
        causal, causality = (is_causal,) * num_layers, f"is_causal={str(is_causal).lower()}"
    rope_keys = ("rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "partial_rotary_factor")
    rope_config = Qwen3Config(
        hidden_size=hidden, num_attention_heads=num_heads, head_dim=head_dim,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        **{k: raw[k] for k in rope_keys if raw.get(k) is not None},
    )
    return DraftConfig(
        hidden_size=hidden, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads), head_dim=head_dim,
        intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=int(raw["vocab_size"]), block_size=int(block_size), mask_token_id=int(mask_id),
        target_layer_ids=tuple(int(t) for t in taps), num_target_layers=n_target, layer_windows=windows,
        layer_causal=causal, causality=causality, rope_config=rope_config,
        input_embedding_scale=_number(raw, dc, "input_embedding_scale", 1.0, where),
        output_multiplier=_number(raw, dc, "output_multiplier", 1.0, where),
        final_logit_softcapping=_number(raw, dc, "final_logit_softcapping", 0.0, where),
        attention_sinks=bool(_flag(raw, dc, "attention_sink_bias", where)), selector=selector,
    )


def _flag(raw: dict, dc: dict, key: str, where: str) -> bool | None:
    """A boolean field given at the top level or in dflash_config (None when neither has it); both must agree."""
    values = {v for v in (raw.get(key), dc.get(key)) if v is not None}
    if len(values) > 1:
        raise DDTreeError(f"{where}: inconsistent {key}: {raw[key]} at the top level, {dc[key]} in dflash_config")
    if values and not isinstance(next(iter(values)), bool):
        raise DDTreeError(f"{where}: {key} must be true or false, got {next(iter(values))!r}")
    return next(iter(values), None)


def _number(raw: dict, dc: dict, key: str, default: float, where: str) -> float:
    """A numeric field of dflash_config (or the top level), `default` when absent or null."""
    value = dc.get(key, raw.get(key))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise DDTreeError(f"{where}: {key} must be a finite number, got {value!r}")
    if key == "final_logit_softcapping" and value < 0:
        raise DDTreeError(f"{where}: final_logit_softcapping must be >= 0, got {value}")
    return float(value)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Qwen3 and Llama compute it: normalise in float32, round, then scale in the input dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (normalise in float32, scale in the input dtype)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.sinks = nn.Parameter(torch.zeros(nh)) if cfg.attention_sinks else None  # per-head sink logits

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V for rows x [B, T, H] -> [B, nkv, T, hd] each."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, q_len, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        kb, vb = self.project_kv(h, cos, sin)
        k = torch.cat([ctx_k, kb], dim=2)
        v = torch.cat([ctx_v, vb], dim=2)
        if self.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            out = sink_attention(q, k, v, mask, self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax also spans a learnable per-head sink logit (a key every query sees, with no value),
    which SDPA cannot take: q [B, nh, Q, d], k, v [B, nkv, K, d], mask [B, 1, Q, K] (True = visible) -> [B, nh, Q, d].
    The softmax runs in float32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights.to(v.dtype) @ v


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """A Qwen3 layer; in a DFlash2 drafter with a dynamic convolution around its attention and its MLP."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        dflash2 = cfg.selector is not None
        self.attention_conv = DynamicConv(cfg.hidden_size, cfg.selector) if dflash2 else None
        self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.selector) if dflash2 else None


class DraftCache:
    """Context K/V per draft layer: one row per committed position, always from target features.

    Block K/V are never stored, so "cropping the block rows" after each call is free.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [B, T]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)


class DFlashDraft(nn.Module):
    """A DFlashDraftModel or DFlash2DraftModel drafter. Tensor names match the public z-lab drafts exactly
    (state_dict keys = safetensors keys)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg.rope_config)
        self.candidate_selector = (CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector)
                                   if cfg.selector is not None else None)

    def place(self, device: torch.device | str, dtype: torch.dtype) -> DFlashDraft:
        """Move weights to device/dtype but keep RoPE frequencies in float32 (bf16 ones drift)."""
        self.to(device=device, dtype=dtype)
        self.rotary = Qwen3RotaryEmbedding(self.config.rope_config).to(device)
        return self

    def context_kv(
        self, ctx_feats: torch.Tensor, ctx_pos: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V of context rows: every layer projects the same fc+hidden_norm features (KV injection)."""
        ctx = self.hidden_norm(self.fc(ctx_feats.to(dtype)))
        cos, sin = self.rotary(ctx, ctx_pos)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def extend_context(self, cache: DraftCache, ctx_feats: torch.Tensor, ctx_pos: torch.Tensor) -> None:
        """Append newly committed rows (their tap features [B, C, k*H] at positions [B, C]) to the cache."""
        for i, (k, v) in enumerate(self.context_kv(ctx_feats, ctx_pos, self.hidden_norm.weight.dtype)):
            cache.append(i, k, v)
        cache.positions = ctx_pos if cache.positions is None else torch.cat([cache.positions, ctx_pos], dim=1)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_pos: torch.Tensor,
        ctx_feats: torch.Tensor | None = None,
        ctx_pos: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the block queries over context + block keys; returns final-normed hidden states [B, Q, H].

        block_embeds [B, Q, H] are target embeddings of the block tokens (scaled here by the checkpoint's
        input_embedding_scale) at positions block_pos [B, Q], Q a whole number of blocks. Context keys come from
        `cache` (decoding) or from ctx_feats [B, C, k*H] at ctx_pos [B, C] (training). `mask` [B, 1, Q, keys]
        (bool, True = visible) restricts visibility further, e.g. to train on many blocks at once; each layer's
        causality and window apply on top (`_layer_masks`). A DFlash2 layer convolves each block's rows around
        its attention and its MLP, with the dynamic taps of the sub-block's normed input (dflash2.md §3).
        """
        if cache is not None:
            layer_ctx = list(zip(cache.keys, cache.values, strict=True))
            key_pos_ctx = cache.positions
        elif ctx_feats is not None:
            layer_ctx = self.context_kv(ctx_feats, ctx_pos, block_embeds.dtype)
            key_pos_ctx = ctx_pos
        else:
            raise ValueError("the draft needs context: a cache or ctx_feats")
        cos, sin = self.rotary(block_embeds, block_pos)
        masks = self._layer_masks(block_pos, torch.cat([key_pos_ctx, block_pos], dim=1), mask)
        bs = self.config.block_size
        x = block_embeds * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 \
            else block_embeds
        for i, layer in enumerate(self.layers):
            ck, cv = layer_ctx[i]
            rule = self.config.layer_rules[i]
            h = layer.input_layernorm(x)
            if layer.attention_conv is None:
                x = x + layer.self_attn(h, cos, sin, ck, cv, masks[rule])
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                continue
            taps = layer.attention_conv.taps(h)
            a = layer.self_attn(layer.attention_conv(h, taps, 0, bs), cos, sin, ck, cv, masks[rule])
            x = x + layer.attention_conv(a, taps, 1, bs)
            h = layer.post_attention_layernorm(x)
            taps = layer.mlp_conv.taps(h)
            x = x + layer.mlp_conv(layer.mlp(layer.mlp_conv(h, taps, 0, bs)), taps, 1, bs)
        return self.norm(x)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of the draft's hidden states, times output_multiplier, then soft-capped
        (cap * tanh(logits / cap)) when final_logit_softcapping > 0; float32 when either applies."""
        multiplier, cap = self.config.output_multiplier, self.config.final_logit_softcapping
        if multiplier != 1.0:
            logits = logits.float() * multiplier
        if cap > 0:
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    def propose(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                token_ids: torch.Tensor | None, anchor: int) -> torch.Tensor | Transitions:
        """What a block drafts from, given its hidden states [D, H] below the anchor: DFlash's per-depth logits
        [D, V] (over the head's columns: token c, or token_ids[c] with a draft vocabulary), or DFlash2's
        transition model over each depth's top-k candidates (dflash2.md §5-6)."""
        logits = self.finish_logits(head(hidden))
        if self.candidate_selector is None:
            return logits
        k = min(self.candidate_selector.top_k, logits.shape[-1])
        unary, columns = logits.float().topk(k, dim=-1)
        tokens = columns if token_ids is None else token_ids[columns]
        anchor_id = torch.tensor(anchor, device=tokens.device)
        return Transitions(self.candidate_selector.transition_logp(unary, tokens, hidden, anchor_id), tokens)

    def _layer_masks(
        self, q_pos: torch.Tensor, k_pos: torch.Tensor, mask: torch.Tensor | None
    ) -> dict[tuple[int | None, bool], torch.Tensor | None]:
        """One mask per distinct (window, causal) rule, `mask` and'ed in: a causal layer's query sees keys at
        positions <= its own, within `window` when it has one (0 <= q - k < window); a bidirectional one every
        key, within a symmetric window (|q - k| < window), HF's semantics for non-causal sliding layers."""
        out: dict[tuple[int | None, bool], torch.Tensor | None] = {}
        rel = q_pos[:, :, None] - k_pos[:, None, :]
        for window, causal in set(self.config.layer_rules):
            m = mask
            rule = []
            if causal:
                rule.append(rel >= 0)
            if window is not None:
                rule.append((rel if causal else rel.abs()) < window)
            for visible in rule:
                m = visible[:, None] if m is None else m & visible[:, None]
            out[window, causal] = m
        return out


def load_draft(
    draft_dir: str | Path,
    target: TargetShape,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    mask_token_from_tokenizer: int | None = None,
) -> DFlashDraft:
    """Load a z-lab DFlash or DFlash2 draft directory, checking it against its target; one-line errors. Logs the
    family and the causality rule applied to each layer (logger `ddtree.draft`)."""
    d = Path(draft_dir)
    if not d.is_dir():
        raise DDTreeError(f"draft directory {d} does not exist")
    cfg_path, weights_path = d / "config.json", d / "model.safetensors"
    if not cfg_path.is_file():
        raise DDTreeError(f"draft directory {d} has no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise DDTreeError(f"{cfg_path} is not valid JSON: {exc}") from None
    cfg = parse_draft_config(raw, target, where=str(cfg_path), mask_token_from_tokenizer=mask_token_from_tokenizer)
    if not weights_path.is_file():
        raise DDTreeError(f"draft directory {d} has no model.safetensors")
    check_checkpoint(d)  # a damaged file fails here in one line, not deep in safetensors
    tensors = {_canonical(k.removeprefix("model.")): v for k, v in load_file(str(weights_path)).items()}
    for borrowed in ("embed_tokens.weight", "lm_head.weight"):
        tensors.pop(borrowed, None)  # the target's embedding and head stay authoritative
    model = DFlashDraft(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}  # RoPE buffers are not persistent
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DDTreeError(f"{weights_path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise DDTreeError(f"{weights_path}: unexpected tensor(s) {', '.join(unexpected[:3])}{_hint(unexpected)}")
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise DDTreeError(f"{weights_path}: tensor {k} has shape {list(tensors[k].shape)}, "
                              f"config says {list(shape)}")
    model.load_state_dict(tensors, strict=False)
    log.info("draft %s: %s", d, cfg.describe())
    return model.place(device, dtype).eval()


def _canonical(key: str) -> str:
    """A tensor's name as our module names it (ALIASES: other exporters' names of the same tensor)."""
    for alias, name in ALIASES.items():
        if key.endswith(alias):
            return key[:-len(alias)] + name
    return key


def _hint(unexpected: list[str]) -> str:
    """Why a checkpoint holds tensors its config does not call for, when the names say it."""
    if any(k.startswith("candidate_selector.") or "_conv." in k for k in unexpected):
        return " (DFlash2 tensors, but the config is not a DFlash2 one: inconsistent checkpoint)"
    if any(k.endswith("self_attn.sinks") for k in unexpected):
        return " (attention sinks, but the config does not set attention_sink_bias: inconsistent checkpoint)"
    return ""


def write_draft_checkpoint(out_dir: str | Path, config: dict, state_dict: dict[str, torch.Tensor],
                           dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors in the z-lab layout (no `model.` prefix, no embeddings)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def draft_config_dict(
    *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
    intermediate_size: int, vocab_size: int, block_size: int, mask_token_id: int,
    target_layer_ids: Sequence[int], num_target_layers: int, rope_theta: float = 1e6,
    max_position_embeddings: int = 40960, layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None, rms_norm_eps: float = 1e-6, is_causal: bool | None = None,
    selector: SelectorConfig | None = None,
) -> dict:
    """A config.json for a new draft, in z-lab's layout (top-level block_size, as the Qwen3 drafts); `is_causal`
    when given (our trainer always says how it trained), and DFlash2's fields with a `selector`."""
    dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    if selector is not None:
        dflash_config.update({f: getattr(selector, f) for f in SelectorConfig.__dataclass_fields__})
    return {
        "architectures": ["DFlash2DraftModel" if selector is not None else "DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": dflash_config,
        "num_target_layers": num_target_layers,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "attention_bias": False,
        "vocab_size": vocab_size,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "layer_types": list(layer_types or ["full_attention"] * num_layers),
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
        **({"is_causal": is_causal} if is_causal is not None else {}),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
