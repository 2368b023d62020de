"""The closed-form tree delta rule equals running the recurrence token by token along each node's own path."""

import pytest
import torch
from ddtree.fast.delta import conv_sources, l2_normed, path_state, tree_delta_rule
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
from trees import ancestry, random_tree


def recurrence(q, k, v, g, beta, state, path):
    """float64, one token after the other: the reference kernels' loop."""
    q = l2_normed(q).double() * q.shape[-1] ** -0.5
    k, v, g, beta, s = l2_normed(k).double(), v.double(), g.double(), beta.double(), state.double()
    for j in path:
        s = s * g[j].exp()[:, None, None]
        delta = (v[j] - torch.einsum("hk,hkv->hv", k[j], s)) * beta[j][:, None]
        s = s + k[j][:, :, None] * delta[:, None, :]
    return torch.einsum("hk,hkv->hv", q[path[-1]], s), s


def inputs(n: int, heads: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, heads, 8, generator=gen) for _ in range(2))
    v = torch.randn(n, heads, 6, generator=gen)
    g = -torch.rand(n, heads, generator=gen) * 2  # log decays: exp(g) in (0.13, 1]
    beta = torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, 8, 6, generator=gen)
    return gen, q, k, v, g, beta, state


@pytest.mark.parametrize("n,seed", [(1, 0), (2, 1), (9, 2), (33, 3), (65, 4)])
def test_every_node_output_and_state_equal_its_path_run_alone(n, seed):
    gen, q, k, v, g, beta, state = inputs(n, 3, seed)
    parents = random_tree(n, gen)
    visible, _ = ancestry(parents)
    o, k_normed, u, G = tree_delta_rule(q, k, v, g, beta, visible, state)
    for node in range(n):
        path = [j for j in range(n) if visible[node, j]]
        want_o, want_s = recurrence(q, k, v, g, beta, state, path)
        torch.testing.assert_close(o[node].double(), want_o, atol=2e-5, rtol=2e-5)
        got_s = path_state(k_normed[None], u[None], G[None], visible, state[None], torch.tensor(node))[0]
        torch.testing.assert_close(got_s.double(), want_s, atol=2e-5, rtol=2e-5)


def test_a_causal_chain_equals_the_transformers_recurrent_kernel():
    _, q, k, v, g, beta, state = inputs(12, 4, 5)
    visible = torch.ones(12, 12, dtype=torch.bool).tril()
    o, k_normed, u, G = tree_delta_rule(q, k, v, g, beta, visible, state)
    want_o, want_s = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                      initial_state=state[None], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, want_o[0], atol=1e-5, rtol=1e-5)
    got_s = path_state(k_normed[None], u[None], G[None], visible, state[None], torch.tensor(11))
    torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)


def test_conv_windows_follow_each_path_then_the_committed_columns():
    gen = torch.Generator().manual_seed(0)
    parents = random_tree(30, gen)
    visible, depths = ancestry(parents)
    sources = conv_sources(visible, depths, width=4)
    for node in range(30):
        chain, j = [], node
        while j >= 0:
            chain.append(3 + j)  # nodes sit after the 3 committed columns
            j = parents[j]
        chain += [2, 1, 0]  # then the committed columns, newest first
        assert sources[node].tolist() == chain[:4][::-1]
