"""How much memory the batched path's caches take: the bytes of one slot in every pool, and how many slots fit
what --gpu-memory-utilization leaves once the weights and a full step's activations are counted."""

from __future__ import annotations

import torch

from ddtree.fast.paged_hybrid import HybridRows, RecurrentPool
from ddtree.models.draft import DFlashDraft
from ddtree.models.target import HybridTarget, Target


def slot_bytes(target: Target, draft: DFlashDraft | None) -> int:
    """Bytes one cache slot takes in every pool: the target's K and V in each layer, and the drafter's."""
    cfg = target.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = sum(not hasattr(layer, "linear_attn") for layer in target.layers)  # a hybrid's recurrent ones: none
    size = 2 * attention * cfg.num_key_value_heads * head_dim
    if draft is not None:
        dc = draft.config
        size += 2 * dc.num_layers * dc.num_kv_heads * dc.head_dim
    return size * target.dtype.itemsize


def pool_tokens(engine, options) -> int:
    """Cache slots for the pool: on a GPU what --gpu-memory-utilization leaves once the weights are loaded, less
    room for a full step's activations and logits; elsewhere enough for every sequence at 2048 tokens."""
    if engine.target.device.type != "cuda":
        return options.max_num_seqs * min(engine.max_context, 2048)
    free, total = torch.cuda.mem_get_info(engine.target.device)
    activations = options.max_num_batched_tokens * engine.vocab_size * 4 * 3 + 2 * 2**30  # logits, processing, slack
    if isinstance(engine.target, HybridTarget):  # every sequence's recurrent states (and with prefix caching as
        # many checkpoints of them: fast/batch.py), a verify's record
        states = options.max_num_seqs * (2 if options.prefix_caching else 1)
        activations += (states * RecurrentPool.bytes_per_sequence(engine.target)
                        + HybridRows.buffer_bytes(engine.target, options.max_num_seqs, options.max_num_batched_tokens))
    budget = int(total * options.gpu_memory_utilization) - (total - free) - activations
    tokens = budget // slot_bytes(engine.target, engine.draft)
    if tokens < options.block_size * 2:
        raise ValueError(f"no room for a KV cache: {budget / 2**30:.1f} GiB left at --gpu-memory-utilization "
                         f"{options.gpu_memory_utilization}")
    return tokens
