"""Tree attention's launch choices: configs that outgrow a GPU's shared memory shrink until they fit."""

import pytest
from ddtree.fast import attention


def fake_gpu(limit: int, tried: list[dict]):
    """A launch that fails as Triton does (OutOfResources, before any work) when the tiles' bytes exceed `limit`."""
    def launch(tiles: dict[str, int]) -> None:
        tried.append(tiles)
        need = tiles["block_n"] * tiles["num_stages"]
        if need > limit:
            raise attention.OutOfResources(need, limit, "shared memory")
    return launch


def test_a_config_too_big_for_shared_memory_drops_stages_then_halves_key_tiles_and_is_remembered(monkeypatch):
    monkeypatch.setattr(attention, "_FITTED", {})
    cfg = dict(block_m=16, block_n=128, splits=1, num_warps=4, num_stages=2)
    tried: list[dict] = []
    fit = attention.launch_fitting(fake_gpu(64, tried), cfg, ("head dim 256", "float32"))
    assert fit == {"block_n": 64, "num_stages": 1}
    assert tried == [{"block_n": 128, "num_stages": 2}, {"block_n": 128, "num_stages": 1}, fit]
    tried.clear()  # the next call (a graph capture after its warm-up) launches the fit at once
    assert attention.launch_fitting(fake_gpu(64, tried), cfg, ("head dim 256", "float32")) == fit
    assert tried == [fit]
    tried.clear()  # another head dim or dtype is its own question
    assert attention.launch_fitting(fake_gpu(1000, tried), cfg, ("head dim 128", "bfloat16")) == {
        "block_n": 128, "num_stages": 2}
    assert tried == [{"block_n": 128, "num_stages": 2}]


def test_a_launch_that_fits_no_tile_says_so(monkeypatch):
    monkeypatch.setattr(attention, "_FITTED", {})
    cfg = dict(block_m=16, block_n=32, splits=1, num_warps=4, num_stages=1)
    with pytest.raises(attention.OutOfResources):
        attention.launch_fitting(fake_gpu(8, []), cfg, ("tiny GPU",))
