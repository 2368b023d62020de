"""The gated delta rule over a whole tree in closed form: one batch of matrix products per layer, no loop
over depths, and no per-node state kept.

Per value head the recurrence from a node's parent p to the node i is (k and q L2-normed, q scaled by
1/sqrt(d_k), α = exp(g), S a d_k x d_v matrix, the root's parent being the committed state S0):

    S_i = α_i (I - β_i k_i k_iᵀ) S_p + β_i k_i v_iᵀ,        o_i = S_iᵀ q_i

Write S_i = α_i S_p + k_i u_iᵀ with u_i = β_i (v_i - α_i S_pᵀ k_i), and let G_i be the sum of g over the
ancestors-or-self of i (so exp(G_i - G_j) is the decay from ancestor j down to i). Unrolled along the path,
S_i = exp(G_i) S0 + Σ_{j ⪯ i} exp(G_i - G_j) k_j u_jᵀ, which makes the u's the solution of a unit
lower-triangular system (ancestors come before their descendants in node order):

    u_i + β_i Σ_{j ≺ i} exp(G_i - G_j) (k_iᵀ k_j) u_j = β_i (v_i - exp(G_i) S0ᵀ k_i)
    o_i = exp(G_i) S0ᵀ q_i + Σ_{j ⪯ i} exp(G_i - G_j) (q_iᵀ k_j) u_j

This is the chunked form of the delta rule (fla's chunk kernels, the WY representation) with the causal
mask replaced by the ancestor mask, so a chain (a prompt chunk) is the special case of a causal `visible`.
Every u depends only on its own path, so the state after any node, the one a commit installs, is
S_i = exp(G_i) S0 + Kᵀ diag(w) U with w_j = exp(G_i - G_j) on i's path: `path_state`. The math runs in
float32, as the reference kernels do.
"""

from __future__ import annotations

import torch


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    """fla's (and transformers') L2 norm over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def tree_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    visible: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outputs of every node of a tree (or chain) from the committed state.

    q, k [n, H, d_k] (raw: normed and scaled here), v [n, H, d_v], g (log decay) and beta [n, H],
    visible [n, n] bool (row i marks i's ancestors and i itself; parents precede children), state
    [H, d_k, d_v] float32. Returns (o [n, H, d_v], k normed [n, H, d_k], u [n, H, d_v], G [n, H]): the
    last three are what `path_state` needs to install the state after any node.
    """
    n = q.shape[0]
    q = l2_normed(q) * q.shape[-1] ** -0.5
    k, v, g, beta = l2_normed(k), v.float(), g.float(), beta.float()
    anc = visible.float()
    G = anc @ g  # [n, H]: log decay from the committed state down to each node
    rel = (G.T[:, :, None] - G.T[:, None, :]).masked_fill(~visible, float("-inf")).exp()  # [H, n, n]
    strict = ~torch.eye(n, dtype=torch.bool, device=q.device)
    kk = torch.einsum("ihd,jhd->hij", k, k) * rel * strict
    system = torch.eye(n, device=q.device) + beta.T[:, :, None] * kk
    decayed = G.exp()[..., None]
    rhs = beta[..., None] * (v - decayed * torch.einsum("ihk,hkv->ihv", k, state))
    u = torch.linalg.solve_triangular(system, rhs.transpose(0, 1), upper=False, unitriangular=True)  # [H, n, dv]
    qk = torch.einsum("ihd,jhd->hij", q, k) * rel
    o = decayed * torch.einsum("ihk,hkv->ihv", q, state) + (qk @ u).transpose(0, 1)
    return o, k, u.transpose(0, 1), G


def path_state(k: torch.Tensor, u: torch.Tensor, G: torch.Tensor, visible: torch.Tensor, state: torch.Tensor,
               last: torch.Tensor) -> torch.Tensor:
    """The state after node `last` (a 0-d device index): exp(G_last) S0 + Σ_{j ⪯ last} exp(G_last - G_j) k_j u_jᵀ.

    Takes tree_delta_rule's (k, u, G) with a leading layer dim [L, n, H, ..] and state [L, H, d_k, d_v], so
    one call commits every recurrent layer.
    """
    g_last = G.index_select(1, last.view(1))  # [L, 1, H]
    on_path = visible.index_select(0, last.view(1))[0]  # [n]
    w = (g_last - G).masked_fill(~on_path[None, :, None], float("-inf")).exp()  # [L, n, H]
    return g_last[:, 0, :, None, None].exp() * state + torch.einsum("lnhk,lnh,lnhv->lhkv", k, w, u)


def conv_sources(visible: torch.Tensor, depths: torch.Tensor, width: int) -> torch.Tensor:
    """Where each node's causal-conv window comes from: [n, width] indices into [committed columns
    (width - 1, oldest first) ; the n nodes' inputs], oldest tap first, the node itself last.

    A node's window is its own path: the ancestor t steps up for tap t, and the committed columns once
    the path above the root runs out.
    """
    n = depths.numel()
    past = width - 1
    taps = [past + torch.arange(n, device=depths.device)]
    for t in range(1, width):
        up = visible & (depths[None, :] == depths[:, None] - t)  # the ancestor t steps up, if any
        in_tree = depths >= t
        taps.append(torch.where(in_tree, past + up.int().argmax(dim=1), past - (t - depths)))
    return torch.stack(taps[::-1], dim=1)
