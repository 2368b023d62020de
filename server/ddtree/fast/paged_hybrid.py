"""Hybrid targets (Gated DeltaNet and gated attention) in the batched fast path.

The attention layers keep their K/V in the paged pool as a dense target's do (fast/batch.py). A Gated DeltaNet
layer has no per-token cache: each sequence owns a slot of a `RecurrentPool`, its conv columns and its recurrent
state for every such layer. A forward runs every layer over all the batch's rows at once; a recurrent layer takes
each sequence's rows from that sequence's slot, in the closed form of fast/delta.py (the single-sequence fast
path's `HybridLayers.recurrent`, so each row is computed as it is there).

Two ways a forward leaves the states:

    prefill  a chunk's rows are all committed, so each layer installs the state after the chunk's last row as it
             goes (long chunks in PROMPT_CHUNK pieces, as the single-sequence path does);
    verify   the rows are a tree: the forward leaves a `BatchRecord` (per row: the conv inputs, normed keys, u
             and G), and once the walk has chosen each sequence's accepted path, `commit` installs the state
             after its last node for every recurrent layer and sequence in one batched product.

A verify runs each recurrent layer for all sequences in two launches where the Triton kernels run
(kernels/gdn.varlen_tree_step, over device buffers a CUDA graph replays: `VarlenRows`), else sequence by sequence
in PyTorch. The record lives in buffers sized once for the largest verify, so a captured forward writes where the
commit reads. A sequence's tree is then at most `tree_rows` rows (its root and its nodes): gdn.VARLEN_MAX, where
the device holds the varlen kernels' widest tiles (gdn.varlen_max_rows), else gdn.TREE_MAX. A round whose trees
all fit TREE_MAX rows takes graphs captured at that bound (the kernels' smaller tiles); wider ones, their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ddtree.fast.delta import conv_sources, path_state
from ddtree.fast.hybrid import PROMPT_CHUNK, HybridLayers, Recurrent
from ddtree.kernels import gdn
from ddtree.kernels.gather import embed
from ddtree.kernels.gemm import linear
from ddtree.kernels.jit import triton_works
from ddtree.kernels.paged_attention import PagedLayout, PagedMask
from ddtree.models.hybrid import project
from ddtree.models.target import HybridTarget

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ddtree.core.blocks import BlockManager
    from ddtree.core.rounds import Prefill
    from ddtree.fast.batch_seq import SeqState
    from ddtree.fast.batch_trees import RoundTrees


@dataclass(frozen=True)
class SeqRows:
    """One sequence's share of a hybrid forward: its pool slot, its rows lo..hi-1, their visibility and tree."""

    slot: int
    lo: int
    hi: int
    visible: torch.Tensor  # [n, n] bool, on the host: ancestors and self (a causal chain for a prompt chunk)
    parents: np.ndarray  # [n]: each row's parent among the sequence's rows, -1 for the first (the root)
    depths: np.ndarray  # [n]: each row's position less the sequence's committed length
    saves: tuple[tuple[int, int], ...] = ()  # a prefill's (rows, checkpoint): the states after its first rows


def conv_windows(seqs: list[SeqRows], width: int) -> torch.Tensor:
    """fast/delta.conv_sources for every sequence's rows at once, on the host: [R, width] indices into each
    sequence's own [width - 1 committed columns ; its rows], oldest tap first. Tap t of a row is its ancestor t
    steps up, or a committed column once its path runs out above the root."""
    if not seqs:
        return torch.zeros((0, width), dtype=torch.long)
    past, base = width - 1, seqs[0].lo  # the sequences' rows follow one another from `base`
    lo = np.repeat([s.lo - base for s in seqs], [s.hi - s.lo for s in seqs])
    parents = np.concatenate([np.where(s.parents >= 0, s.parents + s.lo - base, -1) for s in seqs])
    depths = np.concatenate([s.depths for s in seqs])
    out = np.empty((len(lo), width), dtype=np.int64)
    ancestor = np.arange(len(lo))
    out[:, past] = past + ancestor - lo
    for t in range(1, width):
        ancestor = np.where(ancestor >= 0, parents[np.maximum(ancestor, 0)], -1)
        out[:, past - t] = np.where(depths >= t, past + ancestor - lo, past - (t - depths))
    return torch.from_numpy(out)


@dataclass(frozen=True)
class VarlenRows:
    """A verify's sequences as the varlen kernels read them, besides the paged mask's row and mask offsets."""

    slots: torch.Tensor  # [B] int32: each sequence's pool slot
    sources: torch.Tensor  # [R, W] int64: each row's conv window in its sequence's [committed columns ; rows]
    max_rows: int  # a bound on any sequence's rows


@dataclass(frozen=True)
class BatchRecord:
    """What a verify forward leaves for `commit`, by global row (leading dim: the recurrent layers). Sequence b's
    conv inputs sit at rows lo_b + b*(W-1).. of `inputs`: its W-1 committed columns, then its rows'."""

    inputs: torch.Tensor  # [L, B*(W-1) + R, C]
    keys: torch.Tensor  # [L, R, H, d_k]
    u: torch.Tensor  # [L, R, H, d_v]
    decay: torch.Tensor  # [L, R, H]
    sources: torch.Tensor  # [R, W] on the host: each row's conv window in its sequence's segment of `inputs`

    def of(self, index: int, b: int, seq: SeqRows, past: int) -> Recurrent:
        """Sequence b's record in recurrent layer `index` (views)."""
        seg, device = seq.lo + b * past, self.keys.device
        return Recurrent(self.inputs[index, seg:seg + past + seq.hi - seq.lo], self.keys[index, seq.lo:seq.hi],
                         self.u[index, seq.lo:seq.hi], self.decay[index, seq.lo:seq.hi], seq.visible.to(device),
                         self.sources[seq.lo:seq.hi].to(device))


class RecurrentPool:
    """The conv columns and recurrent state of every Gated DeltaNet layer, one slot per running sequence. A slot
    is zeroed when a sequence takes it (its prompt starts from the zero state) and is free again when it leaves.
    With prefix caching, checkpoints keep the states after cached prefixes (core/prefix_cache.py): a prefill saves
    them at block boundaries, and a sequence whose prompt hits a cached prefix starts from the one at its end."""

    def __init__(self, hybrid: HybridLayers, seqs: int, dtype: torch.dtype, device: torch.device) -> None:
        layers = len(hybrid.recurrent_index)
        self.conv = torch.zeros((layers, seqs, hybrid.conv_width - 1, hybrid.conv_dim), dtype=dtype, device=device)
        self.state = torch.zeros((layers, seqs, *hybrid.state_shape), dtype=torch.float32, device=device)
        self.free = list(range(seqs))
        self.slots: dict[int, int] = {}
        self.saved_conv = self.saved_state = None

    def keep_checkpoints(self, count: int) -> None:
        """Room for `count` checkpoints of every recurrent layer's states."""
        self.saved_conv = self.conv.new_zeros((self.conv.shape[0], count, *self.conv.shape[2:]))
        self.saved_state = self.state.new_zeros((self.state.shape[0], count, *self.state.shape[2:]))

    def restore(self, seq_id: int, checkpoint: int) -> None:
        """The sequence's states become those of a checkpoint: it goes on from a cached prefix."""
        slot = self.slots[seq_id]
        self.conv[:, slot] = self.saved_conv[:, checkpoint]
        self.state[:, slot] = self.saved_state[:, checkpoint]

    @staticmethod
    def bytes_per_sequence(target: HybridTarget) -> int:
        """A slot's size: what the pool adds to a sequence's memory beyond its K/V."""
        layers = [layer.linear_attn for layer in target.layers if hasattr(layer, "linear_attn")]
        first = layers[0]
        conv = (first.conv_kernel_size - 1) * first.conv_dim * target.dtype.itemsize
        return len(layers) * (conv + first.num_v_heads * first.head_k_dim * first.head_v_dim * 4)

    def open(self, seq_id: int) -> None:
        slot = self.free.pop(0)
        self.conv[:, slot].zero_()
        self.state[:, slot].zero_()
        self.slots[seq_id] = slot

    def close(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)


class HybridRows:
    """A hybrid target's batched forward: attention over the paged pool, recurrent layers over the states pool."""

    def __init__(self, target: HybridTarget, ops, seqs: int, rows: int) -> None:
        self.target, self.model = target, target.model.model
        self.hybrid = hybrid = HybridLayers(self.model, ops, target.config, target.device)
        self.pool = RecurrentPool(hybrid, seqs, target.dtype, target.device)
        self.past = hybrid.conv_width - 1
        # every recurrent layer in the varlen kernels, and the commit in one kernel (gdn.commit_states); else each
        # sequence in turn, and the commit's steps, in PyTorch
        self.varlen = triton_works(target.device) and all(
            gdn.varlen_takes(hybrid.decoder[i].linear_attn) for i in hybrid.recurrent_index)
        layers, (heads, d_k, d_v), device = len(hybrid.recurrent_index), hybrid.state_shape, target.device
        self.tree_rows = gdn.varlen_max_rows(device)  # the most rows a sequence's tree may have
        rows = self.record_rows(seqs, rows, self.tree_rows)
        self.buffers = (torch.empty((layers, seqs * self.past + rows, hybrid.conv_dim), dtype=target.dtype,
                                    device=device),
                        torch.empty((layers, rows, heads, d_k), device=device),
                        torch.empty((layers, rows, heads, d_v), device=device),
                        torch.empty((layers, rows, heads), device=device))

    @staticmethod
    def record_rows(seqs: int, rows: int, tree_rows: int) -> int:
        """Rows a verify's record holds: at most `rows`, and each sequence's tree at most `tree_rows`."""
        return min(rows, seqs * tree_rows)

    @staticmethod
    def buffer_bytes(target: HybridTarget, seqs: int, rows: int) -> int:
        """The verify record's buffers: what a batch of up to `rows` rows adds beyond the caches."""
        layers = [layer.linear_attn for layer in target.layers if hasattr(layer, "linear_attn")]
        m, rows = layers[0], HybridRows.record_rows(seqs, rows, gdn.varlen_max_rows(target.device))
        per_row = m.num_v_heads * (m.head_k_dim + m.head_v_dim + 1) * 4 + m.conv_dim * target.dtype.itemsize
        return len(layers) * (per_row * rows + (m.conv_kernel_size - 1) * seqs * m.conv_dim * target.dtype.itemsize)

    def checkpoints(self, chunks: list[Prefill], blocks: BlockManager,
                    states: Mapping[int, SeqState]) -> dict[int, tuple[tuple[int, int], ...]]:
        """The prefix cache's states (core/prefix_cache.py): a sequence whose first chunk starts after a cached
        prefix takes the states checkpointed there; a chunk saves the states at each checkpoint boundary it
        reaches inside its prompt. Returns each sequence's saves (rows into its chunk, checkpoint slot)."""
        every = blocks.prefix.every * blocks.block_size
        for chunk in chunks:  # restores first: a save below may take any checkpoint slot, a hit's one included
            if chunk.start and states[chunk.seq_id].start == 0:
                self.pool.restore(chunk.seq_id, blocks.checkpoint(chunk.seq_id, chunk.start))
        saves = {}
        for chunk in chunks:
            end = min(chunk.start + len(chunk.tokens), len(states[chunk.seq_id].request.prompt_ids))
            saves[chunk.seq_id] = tuple((boundary - chunk.start, blocks.reserve_checkpoint(chunk.seq_id, boundary))
                                        for boundary in range((chunk.start // every + 1) * every, end + 1, every))
        return saves

    def seq_rows(self, seq_ids: list[int], layout: PagedLayout, trees: RoundTrees | None = None,
                 saves: dict[int, tuple[tuple[int, int], ...]] | None = None) -> list[SeqRows]:
        """A forward's sequences: each one's state slot, rows, their visibility, and their tree (each sequence's
        root and `trees`' nodes; without trees, causal chains: prompt chunks), and a prefill's checkpoints to save
        (`saves`). Before any sequence runs (measuring the cost model) the forward reads the slots in order."""
        out = []
        for b, visible in enumerate(layout.visible):
            n = visible.shape[0]
            if trees is None:
                parents, depths = np.arange(-1, n - 1), np.arange(n)
            else:
                parents, depths = trees.lineage(b)
            seq_id = seq_ids[b] if b < len(seq_ids) else None
            out.append(SeqRows(self.pool.slots.get(seq_id, b), layout.row_offsets[b], layout.row_offsets[b + 1],
                               visible, parents, depths, (saves or {}).get(seq_id, ())))
        return out

    def record(self, seqs: list[SeqRows]) -> BatchRecord:
        """The record a verify of these sequences fills (its buffers, and each sequence's conv window sources)."""
        return BatchRecord(*self.buffers, conv_windows(seqs, self.hybrid.conv_width))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: PagedMask,
                kv: torch.Tensor, rope, seqs: list[SeqRows] | None, record: BatchRecord | None,
                taps: tuple[int, ...], logit_rows: torch.Tensor | None = None,
                varlen: VarlenRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every sequence's rows through the target -> logits [N, V] (only `logit_rows`' when given) and the
        drafter's taps. With a record (a verify), the recurrent layers fill it and leave the states alone;
        without (a prefill), each sequence's states move past its rows. With `varlen` (a verify on static
        buffers) the recurrent layers read the sequences from the device and `seqs` is not needed."""
        hybrid = self.hybrid
        x = embed(self.model.embed_tokens, ids)
        cos, sin = rope(positions)
        tapped = []
        for i, layer in enumerate(hybrid.decoder):
            h = hybrid.norm(layer.input_layernorm, x)
            if i in hybrid.recurrent_index:
                index = hybrid.recurrent_index[i]
                if varlen is not None:
                    mixed = self._varlen(layer.linear_attn, index, h, mask, varlen, record)
                else:
                    mixed = self._recurrent(layer.linear_attn, index, h, seqs, record)
            else:
                mixed = hybrid.attention(layer.self_attn, kv[hybrid.attention_index[i]], h, mask, slots, cos, sin)
            x = x + mixed
            x = x + hybrid.mlps[i](hybrid.norm(layer.post_attention_layernorm, x))
            tapped.append(x)
        h = x if logit_rows is None else x.index_select(0, logit_rows)
        lm_head = self.target.lm_head
        logits = linear(hybrid.norm(self.model.norm, h), lm_head.weight, lm_head.bias)
        return logits, (torch.cat([tapped[t] for t in taps], dim=-1) if taps else None)

    def _recurrent(self, module, index: int, h: torch.Tensor, seqs: list[SeqRows],
                   record: BatchRecord | None) -> torch.Tensor:
        """A Gated DeltaNet layer over every sequence's rows, each from its own slot."""
        hybrid, pool = self.hybrid, self.pool
        kernel = index in hybrid.gdn_rows
        out = torch.empty_like(h)
        for b, seq in enumerate(seqs):
            conv, state = pool.conv[index, seq.slot], pool.state[index, seq.slot]
            if record is not None:
                out[seq.lo:seq.hi] = hybrid.recurrent(module, h[seq.lo:seq.hi], record.of(index, b, seq, self.past),
                                                      conv, state, kernel)
                continue
            saves = {seq.lo + rows: checkpoint for rows, checkpoint in seq.saves}
            # a chunk's rows, committed piece by piece; a piece also ends where a checkpoint is saved
            ends = sorted({*range(seq.lo + PROMPT_CHUNK, seq.hi, PROMPT_CHUNK), *saves, seq.hi})
            for lo, hi in zip([seq.lo, *ends[:-1]], ends, strict=True):
                causal = seq.visible[lo - seq.lo:hi - seq.lo, lo - seq.lo:hi - seq.lo].contiguous().to(h.device)
                piece = self._piece(causal)
                out[lo:hi] = hybrid.recurrent(module, h[lo:hi], piece, conv, state, kernel)
                last = torch.tensor(hi - lo - 1, device=h.device)
                state.copy_(path_state(piece.keys[None], piece.u[None], piece.decay[None], causal, state[None],
                                       last)[0])
                conv.copy_(piece.inputs.index_select(0, piece.sources[hi - lo - 1, 1:]))
                if hi in saves:
                    pool.saved_conv[index, saves[hi]].copy_(conv)
                    pool.saved_state[index, saves[hi]].copy_(state)
        return out

    def _varlen(self, module, index: int, h: torch.Tensor, mask: PagedMask, varlen: VarlenRows,
                record: BatchRecord) -> torch.Tensor:
        """A Gated DeltaNet layer over every sequence's tree in the varlen kernels (two launches), from its input
        projections as [qkv ; z ; b ; a] rows: Qwen3.5's fused weight, or Qwen3-Next's two projections reordered."""
        if hasattr(module, "ddtree_in_proj"):
            proj = module.ddtree_in_proj(h)
        else:
            proj = torch.cat([part.reshape(h.shape[0], -1) for part in project(module, h)], dim=-1)
        out = gdn.varlen_tree_step(module, proj, self.pool.conv[index], self.pool.state[index], varlen.slots,
                                   mask.row_offsets, varlen.sources, mask.visible, mask.vis_offsets,
                                   record.inputs[index], record.keys[index], record.u[index], record.decay[index],
                                   varlen.max_rows)
        return self.hybrid.gated_out(module, out, proj[:, module.conv_dim:module.conv_dim + module.value_dim])

    def _piece(self, causal: torch.Tensor) -> Recurrent:
        """One recurrent layer's record for a causal piece of a prompt chunk."""
        n, device = causal.shape[0], self.target.device
        heads, d_k, d_v = self.hybrid.state_shape
        return Recurrent(torch.empty((self.past + n, self.hybrid.conv_dim), dtype=self.target.dtype, device=device),
                         torch.empty((n, heads, d_k), device=device), torch.empty((n, heads, d_v), device=device),
                         torch.empty((n, heads), device=device), causal,
                         conv_sources(causal, torch.arange(n, device=device), self.hybrid.conv_width))

    def commit(self, record: BatchRecord, seqs: list[SeqRows], lasts: list[int]) -> None:
        """Each sequence's states become those after its node `lasts[b]` (an index into its rows), in every
        recurrent layer: exp(G_last) S0 + the path's k uᵀ weighted by their decay, as fast/delta.path_state (in
        place, one kernel for all, where the Triton kernels run)."""
        device = record.keys.device
        last_rows = np.array([seq.lo + last for seq, last in zip(seqs, lasts, strict=True)])
        longest = int(max(seq.depths[last] for seq, last in zip(seqs, lasts, strict=True))) + 1
        paths = np.full((len(seqs), longest), -1, dtype=np.int64)  # each path's rows, root first, padded with -1
        for b, (seq, last) in enumerate(zip(seqs, lasts, strict=True)):
            node, depth = last, seq.depths[last]
            while node >= 0:
                paths[b, depth] = seq.lo + node
                node, depth = seq.parents[node], depth - 1
        slots = torch.tensor([seq.slot for seq in seqs], device=device)
        if self.varlen:
            gdn.commit_states(self.pool.state, slots.int(), record.keys, record.u, record.decay,
                              torch.from_numpy(paths).int().to(device), torch.from_numpy(last_rows).int().to(device))
        else:
            rows, on_path = torch.from_numpy(paths).clamp(min=0).to(device), torch.from_numpy(paths >= 0).to(device)
            g_last = record.decay[:, torch.from_numpy(last_rows).to(device)]  # [L, B, H]
            w = (g_last[:, :, None] - record.decay[:, rows]).masked_fill(~on_path[None, :, :, None],
                                                                          float("-inf")).exp()
            state = g_last.exp()[..., None, None] * self.pool.state.index_select(1, slots) + torch.einsum(
                "lbphk,lbph,lbphv->lbhkv", record.keys[:, rows], w, record.u[:, rows])
            self.pool.state.index_copy_(1, slots, state)
        segments = torch.tensor([seq.lo + b * self.past for b, seq in enumerate(seqs)])
        window = record.sources[torch.from_numpy(last_rows), 1:] + segments[:, None]  # [B, W-1] rows of `inputs`
        self.pool.conv.index_copy_(1, slots, record.inputs[:, window.to(device)])
