"""The wgmma GEMM's host side, without a GPU: launch configs, the generated source, and who takes which rows.

The configs and source are checked on any machine; the products themselves on a Hopper GPU (the tests marked gpu).
"""

import dataclasses

import pytest
import torch
from ddtree.kernels import gemm, wgmma
from marks import gpu

PROJECTIONS = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (1000, 256), (200, 1024)]


@pytest.mark.parametrize(("n", "k"), PROJECTIONS)
@pytest.mark.parametrize("rows", [33, 65, 129, 136])
def test_launch_configs_fit_the_gpu_and_split_k_into_whole_tiles(n, k, rows):
    cfg = wgmma.launch_config(n, k, rows, sms=132)
    assert cfg.bn % 8 == 0 and rows <= cfg.bn < rows + 8  # rows pad to the wgmma N step, not a power of two
    assert 1 <= cfg.consumers <= 3 and cfg.stages >= 2
    assert cfg.shared_bytes + 2048 <= wgmma.SHARED_BYTES
    # one block an SM: two never fit, so a dependent launch cannot crowd its blocks onto the SMs freed first
    assert cfg.shared_bytes <= cfg.launch_shared_bytes <= wgmma.SHARED_BYTES
    assert 2 * (cfg.launch_shared_bytes + 1024) > wgmma.SM_SHARED_BYTES
    k_tiles = k // 64
    assert k_tiles % cfg.splits == 0
    assert cfg.splits == 1 or k_tiles // cfg.splits >= 8
    blocks = -(-n // cfg.block_rows) * cfg.splits
    assert cfg.splits == 1 or blocks <= 132  # splitting never spills a second wave


def test_the_8b_projections_take_the_measured_tiles():
    """Qwen3-8B's verify projections at 65 rows take the tiles that were fastest on the H200 (RESULTS v26)."""
    tiles = {(n, k): (cfg.consumers, cfg.splits) for n, k in [(6144, 4096), (4096, 4096), (24576, 4096),
                                                            (4096, 12288), (151936, 4096)]
             for cfg in [wgmma.launch_config(n, k, 65, sms=132)]}
    assert tiles == {(6144, 4096): (1, 1), (4096, 4096): (1, 2), (24576, 4096): (3, 1), (4096, 12288): (1, 2),
                     (151936, 4096): (3, 1)}


def test_products_that_leave_many_sms_idle_are_left_to_cublaslt():
    """The fill rule: Qwen3-8B's projections keep the GPU busy; a 27B hybrid's 5120-row ones (80 blocks) do not."""
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]:
        assert wgmma.fill(wgmma.launch_config(n, k, 65, sms=132), n, 132) >= wgmma.MIN_FILL, (n, k)
    for n, k in [(5120, 17408), (5120, 6144), (34816, 5120)]:
        assert wgmma.fill(wgmma.launch_config(n, k, 65, sms=132), n, 132) < wgmma.MIN_FILL, (n, k)


@pytest.mark.parametrize(("bn", "dtype", "element"), [(72, torch.bfloat16, "bf16"), (136, torch.float16, "f16")])
def test_the_source_carries_the_tile_and_a_wgmma_of_bn_columns(bn, dtype, element):
    src = wgmma.source(wgmma.Config(2, bn, 4, 2), dtype)
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{element}.{element}" in src
    assert f'"+f"(d[{bn // 2 - 1}])' in src and f'"+f"(d[{bn // 2}])' not in src  # one register per 2 columns
    assert "#define CONSUMERS 2" in src and "#define SPLITS 2" in src and f"#define BN {bn}" in src
    assert src.index("mma_tile(float") < src.index("wgmma_linear(")


def test_the_silu_epilogue_is_a_switch_of_the_source_and_needs_room_for_both_tiles():
    """Config.glu compiles the same kernel with SiLU · up in its epilogue, whose gate and up tiles meet in the stages'
    shared memory: a config whose stages cannot hold them is refused before anything is built."""
    assert "#define GLU 1" in wgmma.source(wgmma.Config(3, 72, 6, 1, glu=True), torch.bfloat16)
    assert "#define GLU 0" in wgmma.source(wgmma.Config(3, 72, 6, 1), torch.bfloat16)
    wgmma.Config(1, 40, 2, 4, glu=True)  # 26 KB of stages for a 5 KB tile
    with pytest.raises(ValueError, match="cannot hold"):
        wgmma.Config(3, 136, 1, 1, glu=True)  # 41 KB of stages, 52 KB of tiles


def test_stages_hold_two_k_boxes_where_each_split_has_whole_stages(monkeypatch):
    """Two 64-wide K boxes a stage (256 contiguous bytes of each weight row), in a ring as deep as shared memory
    holds; one box where a split's K tiles are odd; a config whose splits would end inside a stage is refused."""
    monkeypatch.setattr(wgmma, "BOXES", 2)
    o = wgmma.launch_config(4096, 4096, 65, sms=132)
    assert (o.boxes, o.splits, o.stages) == (2, 2, 6) and o.shared_bytes <= wgmma.SHARED_BYTES
    assert "#define BOXES 2" in wgmma.source(o, torch.bfloat16)
    gate_up = wgmma.launch_config(24576, 4096, 65, sms=132)
    assert (gate_up.consumers, gate_up.boxes, gate_up.stages) == (3, 2, 3)
    dataclasses.replace(gate_up, glu=True)  # the gate and up tiles fit the stages
    assert wgmma.launch_config(4096, 64 * 9, 65, sms=132).boxes == 1  # 9 K tiles
    x, weight = torch.zeros(65, 64 * 9, dtype=torch.bfloat16), torch.zeros(4096, 64 * 9, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole stages"):
        wgmma.linear(x, weight, wgmma.Config(1, 72, 4, 1, boxes=2))


def test_rows_on_the_cpu_never_reach_the_kernel():
    """CPU tensors (every row count) take torch's product; the GPU tests below check that 33-136 rows take it."""
    weight = torch.zeros(64, 128, dtype=torch.bfloat16)
    for rows in (1, 17, 65):
        assert not wgmma.supported(torch.zeros(rows, 128, dtype=torch.bfloat16), weight)
    x = torch.randn(65, 128).to(torch.bfloat16)
    w = torch.randn(64, 128).to(torch.bfloat16)
    assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))
    assert gemm.silu_mul_linear(x, w) is None  # the caller runs the product, then SiLU · up


def _nvrtc_found() -> bool:
    from ddtree.kernels import nvrtc

    try:
        nvrtc._nvrtc()
    except (nvrtc.CudaError, OSError):
        return False
    return True


@pytest.mark.skipif(not _nvrtc_found(), reason="needs libnvrtc (torch's CUDA wheels or the CUDA toolkit)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_8b_tile_compiles_without_a_gpu(dtype):
    """NVRTC builds the kernel for each tile the 8B shape's trees take (no GPU needed), so a change to the CUDA
    source that does not assemble fails here, before any device run."""
    configs = {wgmma.launch_config(n, k, rows) for n, k in PROJECTIONS for rows in (33, 65, 129)}
    configs |= {dataclasses.replace(wgmma.launch_config(24576, 4096, rows), glu=True) for rows in (33, 65, 129)}
    for cfg in configs:
        assert wgmma.cubin(cfg, dtype)[:4] == b"\x7fELF", cfg





def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _fills_the_gpu(n: int, k: int, rows: int) -> bool:
    """The wgmma kernel's fill rule for an [n, k] weight at `rows` rows on this GPU."""
    from ddtree.kernels import wgmma

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return wgmma.fill(wgmma.launch_config(n, k, rows, sms), n, sms) >= wgmma.MIN_FILL


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n", "k", "tiles"), [
    (65, 6144, 4096, None), (65, 4096, 12288, None), (65, 24576, 4096, None), (33, 4100, 4096, None),
    (129, 1000, 256, None), (136, 4096, 4096, None), (40, 200, 1024, (1, 2, 4)), (72, 384, 512, (3, 3, 1))])
def test_wgmma_gemm_equals_a_float64_product_and_repeats_bit_for_bit(dtype, rows, n, k, tiles):
    """The Hopper GEMM for a verify's rows against float64: rows padded to a multiple of 8 (zeros from TMA),
    weights whose rows end inside a tile, K split over blocks (the last one sums in split order), a stage ring
    that wraps; two launches give the same bits (the tickets reset), as do stages of one K box and of two, and
    `gemm.linear` routes these rows to it."""
    import torch.nn.functional as F
    from ddtree.kernels import gemm, wgmma

    gen = torch.Generator().manual_seed(rows + n + k)
    weight = (torch.randn(n, k, generator=gen) / 32).to(dtype).cuda()
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype).cuda()
    config = None if tiles is None else wgmma.Config(tiles[0], wgmma.padded_rows(rows), tiles[1], tiles[2])
    y = wgmma.linear(x, weight, config)
    want = F.linear(x.double(), weight.double())
    assert y.dtype == dtype and torch.allclose(y.double(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(wgmma.linear(x, weight, config), y)
    used = config or wgmma.launch_config(n, k, rows, torch.cuda.get_device_properties(0).multi_processor_count)
    boxes = 1 if used.boxes > 1 else 2
    if (k // 64 // used.splits) % boxes == 0:
        stages = min(used.stages, wgmma.max_stages(used.consumers, used.bn, boxes))
        assert torch.equal(wgmma.linear(x, weight, dataclasses.replace(used, boxes=boxes, stages=stages)), y)
    if tiles is None:  # `gemm.linear` routes these rows to it, unless its blocks would leave many SMs idle
        assert wgmma.supported(x, weight) == _fills_the_gpu(n, k, rows)
        assert not wgmma.supported(x, weight) or torch.equal(gemm.linear(x, weight), y)


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n", "k", "tiles"), [
    (65, 24576, 4096, None), (33, 6000, 1024, None), (129, 2000, 256, None), (136, 8192, 4096, None),
    (40, 400, 1024, (1, 2, 4)), (72, 768, 512, (3, 3, 1)), (65, 4096, 12288, None)])
def test_wgmma_silu_epilogue_equals_the_row_kernel_after_the_product(dtype, rows, n, k, tiles):
    """SiLU(gate) · up in the gate/up product's epilogue gives the bits of ddtree/kernels/rows.py's kernel run on the
    plain product: gate widths that end inside a block (3000 of 96 a block), K split over blocks, a stage ring that
    wraps; and `gemm.silu_mul_linear` takes these rows where the fill rule lets the kernel take the product."""
    from ddtree.kernels import gemm, wgmma
    from ddtree.kernels import rows as row_kernels

    gen = torch.Generator().manual_seed(rows + n + k)
    weight = (torch.randn(n, k, generator=gen) / 16).to(dtype).cuda()
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype).cuda()
    plain = None if tiles is None else wgmma.Config(tiles[0], wgmma.padded_rows(rows), tiles[1], tiles[2])
    want = row_kernels.silu_mul(wgmma.linear(x, weight, plain))
    if tiles is None:
        got = wgmma.silu_mul_linear(x, weight)
        assert wgmma.supported(x, weight) == _fills_the_gpu(n, k, rows)
        fused_act = gemm.silu_mul_linear(x, weight)
        assert fused_act is None if not _fills_the_gpu(n, k, rows) else torch.equal(fused_act, got)
    else:
        got = wgmma.linear(x, weight, dataclasses.replace(plain, glu=True))
    assert got.shape == (rows, n // 2) and want.abs().max() > 0.5
    assert torch.equal(got, want)


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
def test_wgmma_gemm_in_a_graph_reads_what_the_kernel_before_it_wrote():
    """Captured after two Triton row kernels and launched as the second's programmatic dependent, the GEMM loads
    its first weight tiles early (at 65 rows the norms let it launch before they wait, so while the first norm
    may still run) but the rows only after the second is done: replays over new inputs give eager bits."""
    from ddtree.kernels import wgmma
    from ddtree.kernels.rows import rms_norm

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(4096, 4096, generator=gen) / 32).to(torch.bfloat16).cuda()
    norm = torch.rand(4096, generator=gen).to(torch.bfloat16).cuda() + 0.5
    x = torch.empty(65, 4096, dtype=torch.bfloat16, device="cuda")

    def step() -> torch.Tensor:
        return wgmma.linear(rms_norm(rms_norm(x, norm, 1e-6), norm, 1e-6), weight)

    x.copy_(torch.randn(65, 4096, generator=gen))
    step()  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        x.copy_(torch.randn(65, 4096, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, step())


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma needs a Hopper GPU (sm_90)")
def test_a_prompts_rows_build_no_kernel_and_take_the_library_product():
    """A prompt of a length no tree has (rows padded to a count not built yet) must not wait for a kernel build:
    inside prompt_rows its projections are cuBLAS's, the same bits whenever the prompt comes."""
    x = torch.randn(97, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
    built = wgmma._kernel.cache_info().currsize
    with gemm.prompt_rows():
        y = gemm.linear(x, w)
        assert gemm.silu_mul_linear(x, w) is None
    assert wgmma._kernel.cache_info().currsize == built
    assert torch.equal(y, torch.nn.functional.linear(x, w, torch.zeros(4096, device="cuda", dtype=torch.bfloat16)))
    assert wgmma.supported(x, w)  # outside a prompt the same rows take the Hopper GEMM
