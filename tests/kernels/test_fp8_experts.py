"""The fp8 expert kernels (ddtree/kernels/moe.py) against the FP8 target's own experts (Fp8Experts: each product
through gemm.fp8_linear, the reference path's) and against the float64 product of the dequantized operands, in both
scale layouts: per output channel (--quantization fp8) and 128 x 128 blocks (the published checkpoints; also with
each row's own K-block scales, as a gate/up whose gate does not end on a block keeps them).

The blocks here hold SiLU in its linear range (positive rows, positive gate weights: every gate above 17, where
1 + exp(-gate) is 1 in float32 and SiLU is the identity in any implementation), so that what is compared is the
products, their scales and rounding points: the kernels' SiLU (their own exp) and torch's can be an ulp apart,
which can move an e4m3 rounding of SiLU · up (the bf16 experts' tests allow for it). Likewise the router's
weights: both sides get logits whose picks tie, so that each weight is exactly 1 / top_k in any softmax."""

from types import SimpleNamespace

import pytest
import torch
from cases import dequantized_rows, integer_fp8
from marks import gpu, interpreted

LAYOUTS = {"channel": None, "128x128 blocks": (128, 128), "row blocks": (1, 128)}


def fp8_block(layout: str, experts: int, hidden: int, inter: int, top_k: int, seed: int,
              exact: bool = False, device: str = "cpu") -> tuple[torch.nn.Module, SimpleNamespace]:
    """(the reference's Fp8Experts, a sparse block around it) with random weights quantized in `layout`, gate's
    positive; `exact`: integer e4m3 values and power-of-two scales, whose products sum exactly in float32."""
    from ddtree.kernels import fp8
    from ddtree.models.fp8_target import Fp8Experts

    gen = torch.Generator().manual_seed(seed)
    block = LAYOUTS[layout]

    def weight(n: int, k: int, positive: int = 0) -> fp8.Fp8Weight:
        """A random [n, k] weight whose first `positive` rows are positive."""
        if exact:
            values = integer_fp8((n, k), gen).float()
            values[:positive] = values[:positive].abs().clamp(min=1)
            shape = (n,) if block is None else (-(-n // block[0]), k // block[1])
            return fp8.Fp8Weight(values.to(fp8.FP8), 2.0 ** torch.randint(-10, -5, shape, generator=gen).float(),
                                 block)
        dense = torch.randn(n, k, generator=gen) / k**0.5
        dense[:positive] = dense[:positive].abs() + 0.5
        if block is None:
            return fp8.quantize_weight(dense)
        return fp8.expand_rows(fp8.quantize_blocks(dense)) if block[0] == 1 else fp8.quantize_blocks(dense)

    module = Fp8Experts([weight(2 * inter, hidden, positive=inter) for _ in range(experts)],
                        [weight(hidden, inter) for _ in range(experts)], torch.nn.SiLU()).to(device)
    router = SimpleNamespace(weight=torch.zeros(experts, hidden, device=device), top_k=top_k, norm_topk_prob=True)
    return module, SimpleNamespace(gate=router, experts=module)


def tied_logits(rows: int, experts: int, top_k: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Router logits whose top_k largest in each row (random distinct experts) are equal."""
    logits = torch.randn(rows, experts, generator=gen)
    picks = torch.rand(rows, experts, generator=gen).argsort(dim=1)[:, :top_k]
    return logits.scatter(1, picks, 8.0).to(device)


def oracle(module: torch.nn.Module, top_k: int, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The reference path's output for the router's `logits`: its picks, then Fp8Experts."""
    from ddtree.kernels.moe import route

    weights, picks = route(logits, top_k, True)
    return module(h, picks, weights)


def fp8_case(layout: str, rows: int, hidden: int, inter: int) -> tuple:
    """(experts, rows h, logits, the reference's output) for 8 experts (2 a row), `rows` rows."""
    from ddtree.kernels import moe

    module, block = fp8_block(layout, experts=8, hidden=hidden, inter=inter, top_k=2, seed=rows)
    experts = moe.Experts.of(block)
    gen = torch.Generator().manual_seed(rows)
    h, logits = torch.rand(rows, hidden, generator=gen) + 0.25, tied_logits(rows, 8, 2, gen)
    assert experts.fp8 and experts.kernels_take(h)
    return experts, h, logits, oracle(module, 2, h, logits)


@interpreted
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_the_fp8_expert_kernels_equal_the_fp8_experts_bit_for_bit(layout, rows, kernels_on_cpu, monkeypatch):
    """One row (its picks already in order), 6 pairs over 8 experts (a program per pair) and 24 (a program per
    expert, runs longer than one), experts that no row picks; and 12 rows in chunks of 4 (fp8 experts take the
    kernels at any row count, MAX_PAIRS at a time). The few-row GEMM's K tiles and splits (gemm.launch_config) made
    64 wide and 2 to a K for these small widths, as wide weights get them (Qwen3-30B-A3B's gate/up: 4 slices of
    2 x 256 with channel scales, of 4 x 128 with blocks): the same float32 sums in the same order, the same
    rounding points and the interpreter's same e4m3 cast, so the same bits. Also the PyTorch steps', which run
    fp8_linear per expert over every pair: where the pairs fill one 16-row tile, as each expert's rows do in the
    reference (24 pairs take a 32-row tile, whose products the interpreter's NumPy matmul may sum in another order,
    as the machine's BLAS picks its kernel by shape)."""
    from ddtree.kernels import gemm, moe

    def launch_config(n: int, k: int, fp8: bool = False, scale_block: int | None = None) -> dict[str, int]:
        return dict(real(n, k, fp8, scale_block), block_k=64, split_k=2)

    real = gemm.launch_config
    monkeypatch.setattr(gemm, "launch_config", launch_config)
    monkeypatch.setattr(moe, "launch_config", launch_config)
    experts, h, logits, want = fp8_case(layout, rows, hidden=256, inter=256)
    assert torch.equal(experts.routed_by_kernels(h, logits), want)
    if rows * 2 <= 16:
        assert torch.equal(experts.routed_by_torch(h, logits), want)
    if rows == 12:
        monkeypatch.setattr(moe, "MAX_PAIRS", 8)
        assert torch.equal(experts(h, logits), want)


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["channel", "128x128 blocks"])
def test_the_fp8_expert_kernels_equal_the_fp8_experts_at_qwen3_30b_a3b_widths_interpreted(layout, kernels_on_cpu):
    """2048 -> 768 (8 experts, not 128), with gemm.launch_config's own K tiles and slices: gate/up in 4 slices of
    2 x 256 (channel) or 4 x 128 (blocks), down in 3 x 256 (channel) or 2 slices of 3 x 128 (blocks). Two rows:
    4 pairs, sorted by expert, a program per pair (interpreted, each program's wide K loops are slow)."""
    experts, h, logits, want = fp8_case(layout, 2, hidden=2048, inter=768)
    assert torch.equal(experts.routed_by_kernels(h, logits), want)


@interpreted
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_fp8_expert_kernels_equal_the_dequantized_product(layout, kernels_on_cpu):
    """Against float64 products of the dequantized operands (fp8.dequantize), on operands whose gate/up products
    are exact in float32 (integer e4m3 weights, power-of-two scales, rows that quantize without rounding: the
    interpreter's e4m3 cast rounds some values wrongly, tests/kernels/test_fp8.py). SiLU · up is quantized by the
    kernels' own cast (rows.quantize); what is not exact is the down product's float32 sums of e4m3 x integer
    products, against float64: within 1e-6 of the largest output."""
    import torch.nn.functional as F
    from ddtree.kernels import fp8, moe, rows

    module, block = fp8_block(layout, experts=8, hidden=256, inter=128, top_k=2, seed=7, exact=True)
    experts = moe.Experts.of(block)
    group = LAYOUTS[layout] and 128  # block-scaled weights read rows quantized per 128-column group
    gen = torch.Generator().manual_seed(1)
    values = integer_fp8((5, 256), gen).float().abs()
    values[:, ::128] = 448.0  # each group's scale a power of two: its values need no rounding
    h = values * 2.0 ** torch.randint(2, 4, (5, 1), generator=gen).float()  # (every gate above 17)
    logits = tied_logits(5, 8, 2, gen)
    weights, picks = moe.route(logits, 2, True)
    gate_up, down = module.stacked()
    x = dequantized_rows(*fp8.quantize_rows(h, group), group)
    want = torch.zeros(5, 256)
    for j in range(2):
        for r in range(5):
            e = int(picks[r, j])
            gate, up = (x[r] @ fp8.dequantize(gate_up[e]).double().T).float().chunk(2)
            a = dequantized_rows(*rows.quantize((F.silu(gate) * up)[None], group), group)
            y = (a @ fp8.dequantize(down[e]).double().T).float()[0]
            want[r] += y * weights[r, j]
    assert len(picks.unique()) < 8  # experts without a row
    torch.testing.assert_close(experts.routed_by_kernels(h, logits), want, rtol=0.0,
                               atol=1e-6 * want.abs().max().item())


@gpu
@pytest.mark.parametrize("layout", ["channel", "128x128 blocks"])
def test_the_fp8_expert_kernels_equal_the_fp8_experts_at_qwen3_30b_a3b_widths(layout):
    """Qwen3-30B-A3B's widths (128 experts, 8 a token, 2048 -> 768) in bf16: an AR row, a tree of 32 rows and 300
    rows (two chunks of MAX_PAIRS pairs), bit for bit: each pair's products are the few-row GEMM's at the
    reference's rows (the same K tiles on the same tensor-core tile shapes, the same K slices and float32 sums),
    and every expert here gets fewer than 65 rows (more take the GEMM in row tiles without K slices, another
    order of sums)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    from ddtree.kernels import moe

    module, block = fp8_block(layout, experts=128, hidden=2048, inter=768, top_k=8, seed=0, device="cuda")
    experts = moe.Experts.of(block)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 32, 300):
        h = (torch.rand(rows, 2048, generator=gen) + 0.25).to("cuda", torch.bfloat16)
        logits = tied_logits(rows, 128, 8, gen, "cuda").bfloat16()
        assert experts.kernels_take(h) and moe.route(logits, 8, True)[1].flatten().bincount().max() <= 64
        want = oracle(module, 8, h, logits)
        assert torch.equal(experts(h, logits), want), rows
        assert torch.equal(experts(h, logits), want)  # and again (the chunks' buffers)
