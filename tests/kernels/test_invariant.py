"""The CPU paths' products and attention (ddtree/kernels/invariant.py): a row's bits are the same alone and among
other rows, as greedy ddtree == greedy ar needs of an fp8 target (an ulp moves an e4m3 rounding)."""

import torch
import torch.nn.functional as F
from ddtree.kernels import invariant


def test_a_rows_product_has_the_same_bits_at_any_row_count_and_is_the_correctly_rounded_one():
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(17, 256, generator=gen), torch.randn(96, 256, generator=gen), torch.randn(96)
    together = invariant.linear(x, weight, bias)
    assert all(torch.equal(invariant.linear(x[i:i + 1], weight, bias)[0], together[i]) for i in range(17))
    assert torch.equal(together, (x.double() @ weight.double().T + bias.double()).float())
    assert invariant.linear(x.bfloat16(), weight.bfloat16()).dtype == torch.bfloat16


def test_an_attention_row_has_the_same_bits_alone_and_among_a_trees_rows():
    """The last of 9 queries over 40 keys (its mask lets it see all of them) against the same query alone."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, 64, generator=gen) for n in (9, 40, 40))
    mask = torch.zeros(9, 40)
    mask[:8, 35:] = torch.finfo(torch.float32).min  # the other rows see fewer keys
    together = invariant.attention(q, k, v, attn_mask=mask)
    alone = invariant.attention(q[:, :, 8:], k, v)
    assert torch.equal(alone[:, :, 0], together[:, :, 8])


def test_within_row_invariant_transformers_products_and_attention_take_the_float64_sums():
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(128, 64)
    x = torch.randn(5, 128, generator=gen)
    q, k, v = (torch.randn(1, 2, 5, 32, generator=gen) for _ in range(3))
    with invariant.RowInvariant():
        y, a = layer(x), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(y, invariant.linear(x, layer.weight, layer.bias))
    assert torch.equal(a, invariant.attention(q, k, v, is_causal=True))
