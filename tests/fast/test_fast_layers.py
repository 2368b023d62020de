"""Fused weights and fused elementwise steps compute what the model's own modules compute."""

import torch
from ddtree.engine import Engine
from ddtree.fast import layers
from ddtree.fast.layers import Ops, attention_heads, rms_norm
from ddtree.switches import override
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb


def test_fused_weights_are_views_shared_by_every_fast_path(fast_ckpt):
    fast = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu", fast=True)
    attn = fast.target.layers[0].self_attn
    qkv = fast.fast.layers[0].qkv.weight
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()  # the module reads the fused storage: nothing doubled
    assert torch.equal(attn.v_proj.weight, qkv[-attn.v_proj.out_features:])
    again = Engine(fast.target, fast.draft, fast.tokenizer, fast=True)
    assert again.fast.layers[0].qkv.weight is qkv  # a second fast path reuses the fused weights
    draft_layer = fast.draft.layers[1].self_attn
    assert draft_layer.k_proj.weight.data_ptr() == fast.fast.fused_draft.layers[1].kv.weight.data_ptr()


def test_norm_and_rotary_match_the_transformers_modules():
    gen = torch.Generator().manual_seed(0)
    norm = Qwen3RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.randn(16, generator=gen)
    x = torch.randn(5, 3, 16, generator=gen)
    assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))

    n, heads, kv_heads, d = 4, 6, 2, 8
    q, k, v = (torch.randn(n, h * d, generator=gen) for h in (heads, kv_heads, kv_heads))
    cos, sin = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    cache, slots = torch.zeros(2, kv_heads, 10, d), torch.tensor([3, 4, 5, 6])
    grouped = attention_heads(q, k, v, None, None, 1e-6, cos, sin, kv_heads, d, cache, slots)
    new_kv = cache[:, :, 3:7]
    assert not cache[:, :, :3].any() and not cache[:, :, 7:].any()  # only the rows' slots are written
    q_heads, k_heads = q.view(1, n, heads, d).transpose(1, 2), k.view(1, n, kv_heads, d).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q_heads, k_heads, cos[None], sin[None])
    groups = heads // kv_heads
    assert torch.allclose(grouped.view(kv_heads, groups, n, d), q_ref[0].view(kv_heads, groups, n, d))
    assert torch.allclose(new_kv[0], k_ref[0]) and torch.equal(new_kv[1], v.view(n, kv_heads, d).transpose(0, 1))


def test_a_compile_that_fails_falls_back_to_the_eager_step(monkeypatch, capsys):
    def broken_compile(fn, **_):
        def run(*args):
            raise RuntimeError("no C compiler found")
        return run

    monkeypatch.setattr(layers.torch, "compile", broken_compile)
    ops = Ops(compile=True)
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    assert "compiling rms_norm failed (RuntimeError: no C compiler found)" in capsys.readouterr().err
    with override(compile=False):
        assert not Ops(compile=True).compiled
