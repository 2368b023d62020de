"""The wgmma GEMM's host side, without a GPU: launch configs, the generated source, and who takes which rows.

The kernel itself runs only on a Hopper GPU (tests/fast/test_cuda.py); what is pure is checked here.
"""

import dataclasses

import pytest
import torch
from ddtree.kernels import gemm, wgmma

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
    """CPU tensors (every row count) take torch's product; test_cuda.py checks that 33-136 rows take the kernel."""
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
