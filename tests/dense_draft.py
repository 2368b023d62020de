"""The published drafter rules, written out densely in plain PyTorch (float64) straight from a checkpoint's files.

An oracle for the engine's drafters (reference path and fast path): it shares no code with ddtree. It reads
config.json and model.safetensors itself and follows dflash-checkpoint.md §4 (KV injection, per-layer causality:
`is_causal` for every layer when given, else sliding layers causal and full-attention ones bidirectional; HF
windows: 0 <= q - k < W causal, |q - k| < W bidirectional; per-head sinks; input_embedding_scale,
output_multiplier, final_logit_softcapping) and dflash2.md §3-5 (two-tap dynamic convolutions, candidate
selector, greedy chain). One block at a time, every position and key in an explicit loop-free product.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

F64 = torch.float64


class DenseDraft:
    def __init__(self, path: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.cfg = json.loads((Path(path) / "config.json").read_text())
        self.w = {k: v.to(F64) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
        self.embed, self.lm_head = embed.to(F64), lm_head.to(F64)
        c, dc = self.cfg, self.cfg.get("dflash_config", {})
        self.bs = dc.get("block_size") or c["block_size"]
        self.mask_id = dc["mask_token_id"]
        self.layers = c["num_hidden_layers"]
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or c["hidden_size"] // self.nh
        self.eps = c.get("rms_norm_eps", 1e-6)
        rope = c.get("rope_parameters") or {"rope_theta": c["rope_theta"]}
        self.theta = rope["rope_theta"]
        types = c.get("layer_types") or ["full_attention"] * self.layers
        causal = c.get("is_causal", dc.get("is_causal"))
        self.causal = [causal if causal is not None else t == "sliding_attention" for t in types]
        self.window = [c.get("sliding_window") if t == "sliding_attention" else None for t in types]
        self.embedding_scale = dc.get("input_embedding_scale", 1.0)
        self.multiplier = dc.get("output_multiplier", 1.0)
        self.cap = dc.get("final_logit_softcapping") or 0.0
        self.sinks = c.get("attention_sink_bias", False)
        self.dflash2 = "DFlash2DraftModel" in c.get("architectures", [])
        self.top_k = dc.get("selector_top_k")

    def t(self, name: str) -> torch.Tensor:
        """A tensor by its published name (sinks under either exporter's name)."""
        if name in self.w:
            return self.w[name]
        return self.w[name.replace("self_attn.sinks", "self_attn.attention_sink_bias")]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of x [T, heads, d] at integer positions [T]."""
        d = x.shape[-1]
        freq = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=F64) / d)
        angle = pos.to(F64)[:, None] * freq[None]
        cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    def visible(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        rel = q_pos[:, None] - k_pos[None, :]
        seen = rel >= 0 if self.causal[layer] else torch.ones_like(rel, dtype=torch.bool)
        w = self.window[layer]
        if w is not None:
            seen = seen & ((rel if self.causal[layer] else rel.abs()) < w)
        return seen

    def conv(self, x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_o (base[o] + taps[t, o] broadcast over each group) * x[t - o], zero before row 0."""
        rows, width = x.shape
        out = torch.zeros_like(x)
        for t in range(rows):
            for o in range(base.shape[0]):
                if t - o >= 0:
                    dyn = taps[t, o].repeat_interleave(width // taps.shape[-1])
                    out[t] += (base[o] + dyn) * x[t - o]
        return out

    def heads(self, rows: torch.Tensor, proj: str, norm: str | None = None,
              pos: torch.Tensor | None = None) -> torch.Tensor:
        """rows [T, H] projected to [T, heads, d]; with `norm`, per-head normed and rotated at `pos`."""
        y = (rows @ self.t(proj).T).view(len(rows), -1, self.hd)
        return self.rope(self.norm(y, self.t(norm)), pos) if norm else y

    def taps(self, conv: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A convolution pair's dynamic taps of normed rows h [T, H], [T, 2, K, H/G], and its static taps
        [2, K, H]."""
        base = self.t(conv + "base_kernel")
        groups = h.shape[-1] // self.cfg["dflash_config"]["conv_group_size"]
        return (h @ self.t(conv + "kernel_projection.weight").T).view(len(h), 2, base.shape[1], groups), base

    def hidden(self, anchor: int, start: int, ctx: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [bs, H] of the block [anchor, mask...] at start.. over context features
        ctx [start, k*H] (rows at positions 0..start-1)."""
        t = self.t
        ids = torch.tensor([anchor] + [self.mask_id] * (self.bs - 1))
        x = self.embed[ids] * self.embedding_scale
        c = self.norm(ctx.to(F64) @ t("fc.weight").T, t("hidden_norm.weight"))
        ctx_pos, block_pos = torch.arange(start), torch.arange(start, start + self.bs)
        groups = self.nh // self.nkv
        for i in range(self.layers):
            p = f"layers.{i}."
            h = self.norm(x, t(p + "input_layernorm.weight"))
            if self.dflash2:
                taps, base = self.taps(p + "attention_conv.", h)
                h = self.conv(h, taps[:, 0], base[0])
            a = p + "self_attn."
            q = self.heads(h, a + "q_proj.weight", a + "q_norm.weight", block_pos)
            k = torch.cat([self.heads(c, a + "k_proj.weight", a + "k_norm.weight", ctx_pos),
                           self.heads(h, a + "k_proj.weight", a + "k_norm.weight", block_pos)])
            v = torch.cat([self.heads(c, a + "v_proj.weight"), self.heads(h, a + "v_proj.weight")])
            seen = self.visible(i, block_pos, torch.cat([ctx_pos, block_pos]))
            out = torch.empty(self.bs, self.nh, self.hd, dtype=F64)
            for head in range(self.nh):
                scores = q[:, head] @ k[:, head // groups].T / math.sqrt(self.hd)
                scores = scores.masked_fill(~seen, float("-inf"))
                if self.sinks:
                    sink = t(a + "sinks")[head].expand(self.bs, 1)
                    weights = torch.softmax(torch.cat([scores, sink], -1), -1)[:, :-1]
                else:
                    weights = torch.softmax(scores, -1)
                out[:, head] = weights @ v[:, head // groups]
            attended = out.reshape(self.bs, -1) @ t(a + "o_proj.weight").T
            if self.dflash2:
                attended = self.conv(attended, taps[:, 1], base[1])
            x = x + attended
            h = self.norm(x, t(p + "post_attention_layernorm.weight"))
            if self.dflash2:
                taps, base = self.taps(p + "mlp_conv.", h)
                h = self.conv(h, taps[:, 0], base[0])
            m = p + "mlp."
            gate, up = h @ t(m + "gate_proj.weight").T, h @ t(m + "up_proj.weight").T
            out = (gate * torch.sigmoid(gate) * up) @ t(m + "down_proj.weight").T
            if self.dflash2:
                out = self.conv(out, taps[:, 1], base[1])
            x = x + out
        return self.norm(x, t("norm.weight"))

    def logits(self, anchor: int, start: int, ctx: torch.Tensor) -> torch.Tensor:
        """The block's draft logits [bs-1, V] below the anchor: LM head, multiplier, softcap."""
        logits = self.hidden(anchor, start, ctx)[1:] @ self.lm_head.T * self.multiplier
        return self.cap * torch.tanh(logits / self.cap) if self.cap > 0 else logits

    def transitions(self, anchor: int, start: int, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash2: (log P(candidate j at depth d+1 | candidate i at depth d) [D, k, k], candidates [D, k]), the
        selector's score softmaxed over each depth's top-k candidates; depth 1 after the anchor in every row."""
        hidden = self.hidden(anchor, start, ctx)[1:]
        unary, cand = self.logits(anchor, start, ctx).topk(self.top_k, dim=-1)
        p = hidden @ self.t("candidate_selector.hidden_projection.weight").T
        pred, succ = self.t("candidate_selector.predecessor_codebook"), self.t("candidate_selector.successor_codebook")
        logp = torch.empty(len(cand), self.top_k, self.top_k, dtype=F64)
        for d in range(len(cand)):
            for i in range(self.top_k):
                prev = anchor if d == 0 else int(cand[d - 1, i])
                score = unary[d] + (pred[prev] * p[d]) @ succ[cand[d]].T
                logp[d, i] = torch.log_softmax(score, -1)
        return logp, cand

    def chain(self, anchor: int, start: int, ctx: torch.Tensor) -> list[int]:
        """The selector's greedy chain: each position's best-scoring candidate given the previous pick."""
        hidden = self.hidden(anchor, start, ctx)[1:]
        unary, cand = self.logits(anchor, start, ctx).topk(self.top_k, dim=-1)
        p = hidden @ self.t("candidate_selector.hidden_projection.weight").T
        pred, succ = self.t("candidate_selector.predecessor_codebook"), self.t("candidate_selector.successor_codebook")
        out, prev = [], anchor
        for d in range(len(cand)):
            score = unary[d] + (pred[prev] * p[d]) @ succ[cand[d]].T
            prev = int(cand[d, int(score.argmax())])
            out.append(prev)
        return out
