"""A Gated DeltaNet layer between its input projection and its output projection, in Triton kernels: one
for an AR step (one row), two for a small tree.

Run as PyTorch steps the layer is some thirty small kernels there (the conv window's copies and gather, the
conv and gates, the head split, the norms, batched products and a solve), and at batch 1 each costs a launch
and a ramp.

AR step. For one row the closed form of fast/delta.py needs no triangular solve: with S0 the committed state
of a value head, k and q L2-normed (q scaled by 1/sqrt(d_k)), α = exp(g),

    u = β (v - α S0ᵀ k),        o = α S0ᵀ q + (qᵀ k) u

One program per value head does all of it: the causal conv of its q, k and v channels over the committed
columns and the new row (SiLU, rounded to the model dtype as the compiled step rounds it), the gates
(β = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)), the L2 norms, the two products with its state (read
once), u and o, and Qwen3.5's gated RMSNorm of o. That took the Qwen3.6-27B shape's AR step from 18.13 to
16.05 ms.

Tree (up to TREE_MAX nodes). The first kernel is the AR step's conv, gates and norms per (node, value head),
each node's window read along its own path; the second, per (value head, slice of d_v), is fast/delta.py's
closed form, a tile of rows at a time: K Kᵀ and the state products in d_k chunks on the tensor cores
(tf32x3), the unit lower-triangular system solved by forward substitution, then o. The gated norm stays the
fast path's compiled step. On the Qwen3.6-27B shape rounds took 19.49 against 22.43 ms at B = 16, 22.54
against 24.54 at B = 32.

Both write what the commit needs into the same `Recurrent` buffers the PyTorch steps fill (the conv window's
columns, the normed keys, u and G), so the commit is unchanged.

Batch (continuous batching). `varlen_tree_step` runs the two tree kernels over many sequences at once, the
sequence one more grid axis: each program reads its sequence's row range, slot in the conv and state pools and
mask offset from device tensors and runs the same jit helpers as a single tree (the single-tree kernels are thin
wrappers of them and build to the same code), so the grids depend on the batch's shape only and a CUDA graph
can capture the call.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch steps
    triton = None

# the AR-step kernel's warps: at 8 its sm_90 build keeps 6.7 KB a thread on the stack, at 4 none
# (benchmarks/kernel_resources.py, Triton 3.6); the Qwen3.6-27B shape's AR step took 16.11 ms at 4, 16.12 at 8
ROW_WARPS = 4
# nodes per tree kernel call; larger trees and prompt chunks take the PyTorch steps. Measured on the Qwen3.6-27B
# shape: at 17-64 nodes the kernels beat the steps (B = 32 round 23.10 against 24.63 ms); 65 nodes pad to
# 128 rows, where the delta kernel's serial solve costs more than the steps (B = 64 round 28.64 against 27.45)
TREE_MAX = 64
# the most rows a sequence's tree takes in the varlen kernels (a batch's verify), where the device's shared memory
# holds the 128-row delta kernel (116 KB at Qwen3.6-27B's widths); a consumer GPU's 99 KB stops at TREE_MAX
VARLEN_MAX, VARLEN_MAX_SHARED = 128, 116 * 1024
# the delta kernel's (warps, rows per product) by padded tree size: the fastest in benchmarks/gdn_tune.py
TREE_CONFIGS = {16: (4, 16), 32: (4, 32), 64: (4, 16), 128: (8, 16)}
TREE_SLICE, TREE_CHUNK = 64, 32  # d_v per program, d_k per product
TREE_PRECISION = "tf32x3"  # the products in three tensor-core passes: float32's accuracy, not FMA's cost
GATED_NORMS = {"Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated"}  # weight * norm(x), times SiLU(gate)


def takes(module: torch.nn.Module) -> bool:
    """Whether the kernel computes this Gated DeltaNet module's step: Qwen3.5's input projections (qkv, z, b,
    a: the fast path fuses them into one, `ddtree_in_proj`, which the kernels read), a SiLU conv and Qwen3.5's
    gated norm, with power-of-two head dims."""
    return (hasattr(module, "in_proj_qkv") and type(module.norm).__name__ in GATED_NORMS
            and varlen_takes(module))


def varlen_max_rows(device: torch.device) -> int:
    """The most rows a sequence's tree may have in `varlen_tree_step` on this device (VARLEN_MAX, or TREE_MAX
    where a block cannot have the 128-row delta kernel's shared memory; the interpreter has no such bound)."""
    if device.type != "cuda":
        return VARLEN_MAX
    shared = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return VARLEN_MAX if shared >= VARLEN_MAX_SHARED else TREE_MAX


def varlen_takes(module: torch.nn.Module) -> bool:
    """Whether `varlen_tree_step` computes this module's delta rule: a SiLU conv and power-of-two head dims, in
    any projection layout (the caller hands it the rows as [qkv ; z ; b ; a], and applies the gated norm)."""
    dims = (getattr(module, "head_k_dim", 0), getattr(module, "head_v_dim", 0))
    return getattr(module, "activation", None) == "silu" and all(d >= 16 and d & (d - 1) == 0 for d in dims)


def row_step(module: torch.nn.Module, proj: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
             inputs: torch.Tensor, keys: torch.Tensor, u: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """One row's Gated DeltaNet mixing: proj [1, conv_dim + value_dim + 2 H] (the fused input projection) ->
    the gated-normed output [1, H * d_v], ready for out_proj.

    Reads the committed conv columns conv_state [W-1, conv_dim] and state [H, d_k, d_v] (float32); writes the
    commit's record: inputs [W, conv_dim] (the committed columns, then the row's), keys [1, H, d_k], u [1, H,
    d_v] and decay [1, H].
    """
    heads, d_k, d_v = state.shape
    conv_dim = conv_state.shape[1]
    taps = module.conv1d.weight.shape[-1]
    out = torch.empty((1, heads * d_v), dtype=proj.dtype, device=proj.device)
    _row_kernel[(heads,)](
        proj, conv_state, module.conv1d.weight, module.A_log, module.dt_bias, state, module.norm.weight, out,
        inputs, keys, u, decay, module.norm.variance_epsilon, d_k ** -0.5,
        CONV_DIM=conv_dim, KEY_DIM=module.key_dim, VALUE_DIM=module.value_dim, HEADS=heads,
        GROUPS=heads // module.num_k_heads, DK=d_k, DV=d_v, TAPS=taps, num_warps=ROW_WARPS)
    return out


def tree_step(module: torch.nn.Module, proj: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
              inputs: torch.Tensor, sources: torch.Tensor, visible: torch.Tensor, keys: torch.Tensor, u: torch.Tensor,
              decay: torch.Tensor) -> torch.Tensor:
    """The delta rule's output o [n, H * d_v] (model dtype, before the gated norm) for a tree of n (up to
    TREE_MAX) nodes, in two kernels.

    The first, one program per (node, value head), is `_row_kernel`'s conv, gates and norms, each node's conv
    window taken from `sources` [n, W] (rows of [committed columns ; the nodes' rows]). The second, one per
    (value head, slice of d_v), is fast/delta.py's closed form over `visible` [n, n] (ancestors, parents
    before children; contiguous, as HybridFastPath makes every tree and prompt chunk's mask): K Kᵀ and the
    state products over d_k in chunks, the unit lower-triangular system solved by forward substitution. The
    commit's record (inputs [W-1+n, conv_dim], keys, u, decay) is filled as the PyTorch steps fill it.
    """
    n = proj.shape[0]
    assert visible.is_contiguous(), "the delta kernel reads the mask's rows at stride n"
    heads, d_k, d_v = state.shape
    conv_dim, taps = conv_state.shape[1], module.conv1d.weight.shape[-1]
    block, slice_v = max(16, triton.next_power_of_2(n)), min(d_v, TREE_SLICE)
    warps, tile = TREE_CONFIGS[block]
    slices = d_v // slice_v
    work = torch.empty(n * heads * (d_k + d_v + 2) + heads * slices * (n + 1) * block, dtype=torch.float32,
                       device=proj.device)  # q, v, β, g per node and head, then each program's system and G
    out = torch.empty((n, heads * d_v), dtype=proj.dtype, device=proj.device)
    _tree_prep_kernel[(n, heads)](
        proj, conv_state, module.conv1d.weight, module.A_log, module.dt_bias, inputs, sources, keys, work,
        d_k ** -0.5, n, proj.stride(0), CONV_DIM=conv_dim, KEY_DIM=module.key_dim, VALUE_DIM=module.value_dim,
        HEADS=heads, GROUPS=heads // module.num_k_heads, DK=d_k, DV=d_v, TAPS=taps, num_warps=1)
    _tree_delta_kernel[(heads, slices)](
        state, visible.view(torch.int8), keys, u, decay, work, out, n, HEADS=heads, DK=d_k, DV=d_v,
        SLICE=slice_v, BLOCK=block, TILE=min(block, tile), CHUNK=min(d_k, TREE_CHUNK),
        PRECISION=TREE_PRECISION, num_warps=warps)
    return out


def varlen_tree_step(module: torch.nn.Module, proj: torch.Tensor, conv_pool: torch.Tensor, state_pool: torch.Tensor,
                     seq_slots: torch.Tensor, row_offsets: torch.Tensor, sources: torch.Tensor, visible: torch.Tensor,
                     vis_offsets: torch.Tensor, inputs: torch.Tensor, keys: torch.Tensor, u: torch.Tensor,
                     decay: torch.Tensor, max_rows: int) -> torch.Tensor:
    """`tree_step` for a batch of B sequences in the same two launches (continuous batching), each sequence with
    its own rows, ancestor mask, committed conv columns and state. The grids depend on B, max_rows and the head
    dims only, never on the data, and the host reads nothing from the device, so a CUDA graph can capture it.

    Sequence b's rows are row_offsets[b]..row_offsets[b+1]-1 (row_offsets [B+1] int32) of proj [R, conv_dim +
    value_dim + 2 H]: none for a padding sequence, and R may end in rows of no sequence. Its committed columns
    and state are conv_pool[seq_slots[b]] and state_pool[seq_slots[b]] (conv_pool [S, W-1, conv_dim],
    state_pool [S, H, d_k, d_v] float32, seq_slots [B] int32), only read. Its [n, n] ancestor mask lies
    row-major at vis_offsets[b] ([B] int32) of the flat int8 (or bool) `visible`; its rows' `sources` [R, W]
    (int64, as conv_sources makes them) index [its committed columns ; its rows].

    max_rows (1..128) bounds every sequence's rows (unchecked) and pads the tree as n does tree_step's; past 64
    the delta kernel takes 116 KB of shared memory at Qwen3.6-27B's widths, over a consumer GPU's 99 KB.

    The record, what a commit needs: inputs [B (W-1) + R, conv_dim], sequence b's W-1 committed columns then
    its rows' conv inputs from row row_offsets[b] + b (W-1); keys [R, H, d_k], u [R, H, d_v] and decay [R, H]
    (float32) by row. Returns o [R, H * d_v] (model dtype, before the gated norm; rows of no sequence
    unspecified).
    """
    rows, batch = proj.shape[0], seq_slots.numel()
    heads, d_k, d_v = state_pool.shape[1:]
    conv_dim, taps = conv_pool.shape[2], module.conv1d.weight.shape[-1]
    block, slice_v = max(16, triton.next_power_of_2(max_rows)), min(d_v, TREE_SLICE)
    warps, tile = TREE_CONFIGS[block]
    slices = d_v // slice_v
    # each sequence's Work as tree_step's for its n rows: q, v, β and g per row and head, then each delta
    # program's system and G, (n + 1) * block floats; n * row_work + seq_work in all, from sequence to sequence
    row_work, seq_work = heads * (d_k + d_v + 2 + slices * block), heads * slices * block
    work = torch.empty(rows * row_work + batch * seq_work, dtype=torch.float32, device=proj.device)
    out = torch.empty((rows, heads * d_v), dtype=proj.dtype, device=proj.device)
    _varlen_prep_kernel[(max_rows, heads, batch)](
        proj, conv_pool, module.conv1d.weight, module.A_log, module.dt_bias, inputs, sources, keys, work, seq_slots,
        row_offsets, d_k ** -0.5, proj.stride(0), ROW_WORK=row_work, SEQ_WORK=seq_work, CONV_DIM=conv_dim,
        KEY_DIM=module.key_dim, VALUE_DIM=module.value_dim, HEADS=heads, GROUPS=heads // module.num_k_heads, DK=d_k,
        DV=d_v, TAPS=taps, num_warps=1)
    _varlen_delta_kernel[(heads, slices, batch)](
        state_pool, visible.view(torch.int8), keys, u, decay, work, out, seq_slots, row_offsets, vis_offsets,
        ROW_WORK=row_work, SEQ_WORK=seq_work, HEADS=heads, DK=d_k, DV=d_v, SLICE=slice_v, BLOCK=block,
        TILE=min(block, tile), CHUNK=min(d_k, TREE_CHUNK), PRECISION=TREE_PRECISION, num_warps=warps)
    return out


COMMIT_TILE = 32  # d_k rows of a state a commit program updates: a [32, d_v] float32 tile in registers


def commit_states(state_pool: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, u: torch.Tensor,
                  decay: torch.Tensor, paths: torch.Tensor, lasts: torch.Tensor) -> None:
    """Each sequence's recurrent state, in place in its pool slot, becomes the state after its accepted path's
    last node, in every layer: S <- exp(G_last) S + Σ_{j on the path} exp(G_last - G_j) k_j u_jᵀ (fast/delta.py's
    path_state). One launch reads and writes each state once, where the PyTorch steps gather, scale, add and
    scatter it (several passes over what, for a 27B hybrid, is 150 MB a sequence).

    state_pool [L, S, H, d_k, d_v] float32; slots [B] int32 (each sequence's slot); keys [L, R, H, d_k], u [L, R,
    H, d_v] and decay [L, R, H] (float32, the verify's record by row); paths [B, P] int32, each sequence's rows
    root first, padded with -1; lasts [B] int32, each path's last row."""
    layers, pool, heads, d_k, d_v = state_pool.shape
    batch, longest = paths.shape
    tile = min(COMMIT_TILE, d_k)
    _commit_kernel[(batch, layers * heads, d_k // tile)](
        state_pool, slots, keys, u, decay, paths, lasts, longest, keys.shape[1], pool, HEADS=heads, DK=d_k, DV=d_v,
        TILE=tile, num_warps=4)


if triton is not None:

    @triton.jit
    def _commit_kernel(StatePool, Slots, Keys, U, Decay, Paths, Lasts, longest, rows, pool, HEADS: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, TILE: tl.constexpr):
        """Sequence b, (layer, value head) lh, d_k tile t: its state tile scaled by the decay down the path, plus
        each path node's k uᵀ weighted by its decay to the last node."""
        b, lh, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        layer, h = lh // HEADS, lh % HEADS
        dk, dv = t * TILE + tl.arange(0, TILE), tl.arange(0, DV)
        slot = tl.load(Slots + b).to(tl.int64)
        state = StatePool + ((layer * pool + slot) * HEADS + h) * (DK * DV) + dk[:, None] * DV + dv[None, :]
        record = layer.to(tl.int64) * rows
        g_last = tl.load(Decay + (record + tl.load(Lasts + b)) * HEADS + h)
        acc = tl.load(state) * tl.exp(g_last)
        for p in range(longest):
            row = tl.load(Paths + b * longest + p)
            if row >= 0:
                node = (record + row) * HEADS + h
                w = tl.exp(g_last - tl.load(Decay + node))
                k = tl.load(Keys + node * DK + dk)
                v = tl.load(U + node * DV + dv)
                acc += (w * k)[:, None] * v[None, :]
        tl.store(state, acc)

    @triton.jit
    def _conv(Proj, ConvState, ConvW, Inputs, ch, WRITE: tl.constexpr, CONV_DIM: tl.constexpr,
              TAPS: tl.constexpr):
        """SiLU of the causal conv over channels `ch` (committed columns, oldest first, then the new row),
        rounded to the model dtype; with WRITE, the window's columns also go to Inputs [TAPS, CONV_DIM]."""
        acc = tl.zeros(ch.shape, tl.float32)
        for t in tl.static_range(TAPS - 1):
            x = tl.load(ConvState + t * CONV_DIM + ch)
            if WRITE:
                tl.store(Inputs + t * CONV_DIM + ch, x)
            acc += x.to(tl.float32) * tl.load(ConvW + ch * TAPS + t).to(tl.float32)
        x = tl.load(Proj + ch)
        if WRITE:
            tl.store(Inputs + (TAPS - 1) * CONV_DIM + ch, x)
        acc += x.to(tl.float32) * tl.load(ConvW + ch * TAPS + TAPS - 1).to(tl.float32)
        return (acc / (1.0 + tl.exp(-acc))).to(Proj.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _l2_normed(x):
        """x / |x| (with fla's 1e-6 inside the root), as the reference's use_qk_l2norm_in_kernel."""
        return x / tl.sqrt(tl.sum(x * x, 0) + 1e-6)

    @triton.jit
    def _gates(Gates, ALog, DtBias, h, HEADS: tl.constexpr):
        """Value head h's β = sigmoid(b) (rounded to the model dtype, as the reference's b.sigmoid()) and
        log decay g = -exp(A_log) softplus(a + dt_bias), from a row's b [HEADS] then a [HEADS] at Gates."""
        b = tl.load(Gates + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(Gates.dtype.element_ty).to(tl.float32)
        a = tl.load(Gates + HEADS + h).to(tl.float32) + tl.load(DtBias + h).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.maximum(a, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(a))))
        return beta, -tl.exp(tl.load(ALog + h).to(tl.float32)) * softplus

    @triton.jit
    def _row_kernel(Proj, ConvState, ConvW, ALog, DtBias, State, NormW, Out, Inputs, Keys, U, Decay, eps, scale,
                    CONV_DIM: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, HEADS: tl.constexpr,
                    GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, TAPS: tl.constexpr):
        """Value head `h`: its conv, gates, normed q/k, the state products, u, o and the gated norm of o."""
        h = tl.program_id(0)
        k_head = h // GROUPS
        dk, dv = tl.arange(0, DK), tl.arange(0, DV)
        first = h % GROUPS == 0  # q/k channels are shared by GROUPS value heads: one of them writes them
        q = _conv(Proj, ConvState, ConvW, Inputs, k_head * DK + dk, first, CONV_DIM, TAPS)
        k = _conv(Proj, ConvState, ConvW, Inputs, KEY_DIM + k_head * DK + dk, first, CONV_DIM, TAPS)
        v = _conv(Proj, ConvState, ConvW, Inputs, 2 * KEY_DIM + h * DV + dv, True, CONV_DIM, TAPS)
        q = _l2_normed(q) * scale
        k = _l2_normed(k)
        beta, g = _gates(Proj + CONV_DIM + VALUE_DIM, ALog, DtBias, h, HEADS)
        s = tl.load(State + h * DK * DV + dk[:, None] * DV + dv[None, :])
        alpha = tl.exp(g)
        u = beta * (v - alpha * tl.sum(k[:, None] * s, 0))
        o = alpha * tl.sum(q[:, None] * s, 0) + tl.sum(q * k, 0) * u
        tl.store(Keys + h * DK + dk, k)
        tl.store(U + h * DV + dv, u)
        tl.store(Decay + h, g)
        dtype = Out.dtype.element_ty
        o = o.to(dtype).to(tl.float32)  # the delta rule's output in the model dtype, then Qwen3.5's gated norm
        normed = (o / tl.sqrt(tl.sum(o * o, 0) / DV + eps)).to(dtype)
        scaled = (tl.load(NormW + dv) * normed).to(tl.float32)
        z = tl.load(Proj + CONV_DIM + h * DV + dv).to(tl.float32)
        tl.store(Out + h * DV + dv, (scaled * (z / (1.0 + tl.exp(-z)))).to(dtype))

    @triton.jit
    def _tree_conv(Proj, ConvState, ConvW, Inputs, Sources, i, stride_p, ch, WRITE: tl.constexpr,
                   CONV_DIM: tl.constexpr, TAPS: tl.constexpr):
        """`_conv` for node i: tap t reads row Sources[i, t] of [committed columns ; proj's rows]. With WRITE,
        the node's own row of channels `ch` goes to Inputs [TAPS - 1 + n, CONV_DIM] (node 0 also copies the
        committed columns)."""
        acc = tl.zeros(ch.shape, tl.float32)
        for t in tl.static_range(TAPS):
            src = tl.load(Sources + i * TAPS + t)
            if src < TAPS - 1:
                x = tl.load(ConvState + src * CONV_DIM + ch)
            else:
                x = tl.load(Proj + (src - (TAPS - 1)) * stride_p + ch)
            acc += x.to(tl.float32) * tl.load(ConvW + ch * TAPS + t).to(tl.float32)
        if WRITE:
            tl.store(Inputs + (TAPS - 1 + i) * CONV_DIM + ch, tl.load(Proj + i * stride_p + ch))
            if i == 0:
                for t in tl.static_range(TAPS - 1):
                    tl.store(Inputs + t * CONV_DIM + ch, tl.load(ConvState + t * CONV_DIM + ch))
        return (acc / (1.0 + tl.exp(-acc))).to(Proj.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _tree_prep(Proj, ConvState, ConvW, ALog, DtBias, Inputs, Sources, Keys, Work, scale, i, h, n, stride_p,
                   CONV_DIM: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, HEADS: tl.constexpr,
                   GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, TAPS: tl.constexpr):
        """Node i of a tree of n, value head h: its conv (q, k of the head's key head; v), normed q and k, β and
        g. Keys gets the normed k (the commit's record); Work the scaled q, v, β and g. Every pointer is the
        tree's own (its first row, its committed columns, its record): one tree or one sequence of a batch."""
        k_head = h // GROUPS
        dk, dv = tl.arange(0, DK), tl.arange(0, DV)
        first = h % GROUPS == 0
        q = _tree_conv(Proj, ConvState, ConvW, Inputs, Sources, i, stride_p, k_head * DK + dk, first, CONV_DIM, TAPS)
        k = _tree_conv(Proj, ConvState, ConvW, Inputs, Sources, i, stride_p, KEY_DIM + k_head * DK + dk, first,
                       CONV_DIM, TAPS)
        v = _tree_conv(Proj, ConvState, ConvW, Inputs, Sources, i, stride_p, 2 * KEY_DIM + h * DV + dv, True,
                       CONV_DIM, TAPS)
        beta, g = _gates(Proj + i * stride_p + CONV_DIM + VALUE_DIM, ALog, DtBias, h, HEADS)
        node = i * HEADS + h
        tl.store(Keys + node * DK + dk, _l2_normed(k))
        tl.store(Work + node * DK + dk, _l2_normed(q) * scale)
        tl.store(Work + n * HEADS * DK + node * DV + dv, v)
        gate_base = Work + n * HEADS * (DK + DV)
        tl.store(gate_base + node, beta)
        tl.store(gate_base + n * HEADS + node, g)

    @triton.jit
    def _tile_products(Rows, Keys, State, Vis, GSums, rows, n, cols, col_valid, h, dv, HEADS: tl.constexpr,
                       TILE: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
        """For a tile of node rows x (Rows per node, d_k wide: keys or queries): x Kᵀ over the BLOCK columns'
        keys and x S0 over the d_v slice `dv` of head h's state, in d_k chunks on the tensor cores; with the
        tile's rows of the ancestor mask (int8) and its G (from GSums)."""
        valid = rows < n
        nodes, col_nodes = rows * HEADS + h, cols * HEADS + h
        ck = tl.arange(0, CHUNK)
        xk = tl.zeros((TILE, BLOCK), tl.float32)
        xs = tl.zeros((TILE, SLICE), tl.float32)
        for d in range(0, DK, CHUNK):
            x = tl.load(Rows + nodes[:, None] * DK + d + ck[None, :], mask=valid[:, None], other=0.0)
            k_cols = tl.load(Keys + col_nodes[:, None] * DK + d + ck[None, :], mask=col_valid[:, None], other=0.0)
            xk += tl.dot(x, tl.trans(k_cols), input_precision=PRECISION)
            s = tl.load(State + (h * DK + d + ck[:, None]) * DV + dv[None, :])
            xs += tl.dot(x, s, input_precision=PRECISION)
        vis = tl.load(Vis + rows[:, None] * n + cols[None, :], mask=valid[:, None] & col_valid[None, :], other=0)
        return xk, xs, vis, tl.load(GSums + rows, mask=valid, other=0.0)

    @triton.jit
    def _tree_delta(State, Vis, Keys, U, Decay, Work, Out, n, h, c, HEADS: tl.constexpr, DK: tl.constexpr,
                    DV: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                    CHUNK: tl.constexpr, PRECISION: tl.constexpr):
        """Value head h, d_v slice c (of the grid's axis 1), over the n nodes (BLOCK columns, padded), TILE rows
        at a time so no [BLOCK, BLOCK] product is ever held: G along each path; the system's strict lower part
        L = β exp(G_i - G_j) k_iᵀk_j and right-hand side β (v - exp(G) S0ᵀ k), through memory; u by forward
        substitution; then o = exp(G) S0ᵀ q + (exp(G_i - G_j) q_iᵀk_j over the ancestors) u. Every pointer is
        the tree's own; its Work holds the prep's q, v, β and g, then each (head, slice)'s L rows and G."""
        cols, tile = tl.arange(0, BLOCK), tl.arange(0, TILE)
        dv = c * SLICE + tl.arange(0, SLICE)
        col_valid = cols < n
        col_nodes = cols * HEADS + h
        gate_base = Work + n * HEADS * (DK + DV)
        scratch = gate_base + 2 * n * HEADS + (h * tl.num_programs(1) + c) * (n + 1) * BLOCK  # L rows, then G
        g = tl.load(gate_base + n * HEADS + col_nodes, mask=col_valid, other=0.0)
        for lo in range(0, n, TILE):  # G: the sum of g over each node's ancestors and itself
            rows = lo + tile
            vis = tl.load(Vis + rows[:, None] * n + cols[None, :], mask=(rows < n)[:, None] & col_valid[None, :],
                          other=0) != 0
            big_g = tl.sum(tl.where(vis, g[None, :], 0.0), 1)
            tl.store(scratch + n * BLOCK + rows, big_g, mask=rows < n)
            if c == 0:
                tl.store(Decay + rows * HEADS + h, big_g, mask=rows < n)
        tl.debug_barrier()  # the program's own stores, visible to all its threads
        g_cols = tl.load(scratch + n * BLOCK + cols, mask=col_valid, other=0.0)
        for lo in range(0, n, TILE):  # the system, TILE rows at a time
            rows = lo + tile
            valid = rows < n
            nodes = rows * HEADS + h
            kk, ks, vis, g_rows = _tile_products(Keys, Keys, State, Vis, scratch + n * BLOCK, rows, n, cols, col_valid,
                                                 h, dv, HEADS, TILE, BLOCK, SLICE, DK, DV, CHUNK, PRECISION)
            beta = tl.load(gate_base + nodes, mask=valid, other=0.0)
            strict = (vis != 0) & (rows[:, None] > cols[None, :])
            lower = tl.where(strict, beta[:, None] * kk * tl.exp(g_rows[:, None] - g_cols[None, :]), 0.0)
            tl.store(scratch + rows[:, None] * BLOCK + cols[None, :], lower, mask=valid[:, None])
            v = tl.load(Work + n * HEADS * DK + nodes[:, None] * DV + dv[None, :], mask=valid[:, None], other=0.0)
            tl.store(U + nodes[:, None] * DV + dv[None, :], beta[:, None] * (v - tl.exp(g_rows)[:, None] * ks),
                     mask=valid[:, None])
        tl.debug_barrier()
        # forward substitution (ancestors come before their descendants) on uᵀ [SLICE, BLOCK]: the sum over
        # the nodes runs along the last axis, inside a warp, so a step needs no cross-warp exchange
        u_t = tl.zeros((SLICE, BLOCK), tl.float32)
        for i in range(0, n):
            row = tl.load(scratch + i * BLOCK + cols, mask=cols < i, other=0.0)
            u_i = tl.load(U + (i * HEADS + h) * DV + dv) - tl.sum(row[None, :] * u_t, 1)
            u_t = tl.where((cols == i)[None, :], u_i[:, None], u_t)
        tl.store(U + col_nodes[:, None] * DV + dv[None, :], tl.trans(u_t), mask=col_valid[:, None])
        tl.debug_barrier()
        u = tl.load(U + col_nodes[:, None] * DV + dv[None, :], mask=col_valid[:, None], other=0.0)
        for lo in range(0, n, TILE):  # o, TILE rows at a time
            rows = lo + tile
            valid = rows < n
            qk, qs, vis, g_rows = _tile_products(Work, Keys, State, Vis, scratch + n * BLOCK, rows, n, cols, col_valid,
                                                 h, dv, HEADS, TILE, BLOCK, SLICE, DK, DV, CHUNK, PRECISION)
            qk = tl.where(vis != 0, qk * tl.exp(g_rows[:, None] - g_cols[None, :]), 0.0)
            o = tl.exp(g_rows)[:, None] * qs + tl.dot(qk, u, input_precision=PRECISION)
            tl.store(Out + rows[:, None] * (HEADS * DV) + h * DV + dv[None, :], o.to(Out.dtype.element_ty),
                     mask=valid[:, None])

    @triton.jit
    def _tree_prep_kernel(Proj, ConvState, ConvW, ALog, DtBias, Inputs, Sources, Keys, Work, scale, n, stride_p,
                          CONV_DIM: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                          HEADS: tl.constexpr, GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          TAPS: tl.constexpr):
        """One tree: node i = program 0, value head h = program 1."""
        _tree_prep(Proj, ConvState, ConvW, ALog, DtBias, Inputs, Sources, Keys, Work, scale, tl.program_id(0),
                   tl.program_id(1), n, stride_p, CONV_DIM, KEY_DIM, VALUE_DIM, HEADS, GROUPS, DK, DV, TAPS)

    @triton.jit
    def _tree_delta_kernel(State, Vis, Keys, U, Decay, Work, Out, n, HEADS: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                           CHUNK: tl.constexpr, PRECISION: tl.constexpr):
        """One tree: value head h = program 0, d_v slice c = program 1."""
        _tree_delta(State, Vis, Keys, U, Decay, Work, Out, n, tl.program_id(0), tl.program_id(1), HEADS, DK, DV,
                    SLICE, BLOCK, TILE, CHUNK, PRECISION)

    @triton.jit
    def _varlen_prep_kernel(Proj, ConvPool, ConvW, ALog, DtBias, Inputs, Sources, Keys, Work, SeqSlots, RowOffsets,
                            scale, stride_p, ROW_WORK: tl.constexpr, SEQ_WORK: tl.constexpr,
                            CONV_DIM: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                            HEADS: tl.constexpr, GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            TAPS: tl.constexpr):
        """Sequence b = program 2 of a batch, its node i = program 0 (past its rows: nothing), value head h =
        program 1: `_tree_prep` on the sequence's rows, pool slot and segments of the record and of Work (its
        own tree's Work at row_offsets[b] * ROW_WORK + b * SEQ_WORK)."""
        i, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        lo = tl.load(RowOffsets + b)
        n = tl.load(RowOffsets + b + 1) - lo
        if i >= n:
            return
        slot = tl.load(SeqSlots + b).to(tl.int64)
        _tree_prep(Proj + lo * stride_p, ConvPool + slot * ((TAPS - 1) * CONV_DIM), ConvW, ALog, DtBias,
                   Inputs + (lo + b * (TAPS - 1)) * CONV_DIM, Sources + lo * TAPS, Keys + lo * (HEADS * DK),
                   Work + lo * ROW_WORK + b * SEQ_WORK, scale, i, h, n, stride_p, CONV_DIM, KEY_DIM, VALUE_DIM, HEADS,
                   GROUPS, DK, DV, TAPS)

    @triton.jit
    def _varlen_delta_kernel(StatePool, Vis, Keys, U, Decay, Work, Out, SeqSlots, RowOffsets, VisOffsets,
                             ROW_WORK: tl.constexpr, SEQ_WORK: tl.constexpr, HEADS: tl.constexpr, DK: tl.constexpr,
                             DV: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                             CHUNK: tl.constexpr, PRECISION: tl.constexpr):
        """Sequence b = program 2 of a batch (no rows: nothing), value head h = program 0, d_v slice c = program
        1: `_tree_delta` on the sequence's pool slot, mask and segments."""
        h, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        lo = tl.load(RowOffsets + b)
        n = tl.load(RowOffsets + b + 1) - lo
        if n == 0:
            return
        slot = tl.load(SeqSlots + b).to(tl.int64)
        _tree_delta(StatePool + slot * (HEADS * DK * DV), Vis + tl.load(VisOffsets + b), Keys + lo * (HEADS * DK),
                    U + lo * (HEADS * DV), Decay + lo * HEADS, Work + lo * ROW_WORK + b * SEQ_WORK,
                    Out + lo * (HEADS * DV), n, h, c, HEADS, DK, DV, SLICE, BLOCK, TILE, CHUNK, PRECISION)
