"""Launch configs that outgrow a GPU's shared memory shrink until they fit (jit.launch_fitting)."""

import pytest
from ddtree.kernels import jit


def fake_gpu(limit: int, tried: list[dict]):
    """A launch that fails as Triton does (OutOfResources, before any work) when the tiles' bytes exceed `limit`."""
    def launch(tiles: dict[str, int]) -> None:
        tried.append(tiles)
        need = tiles["block_n"] * tiles["num_stages"]
        if need > limit:
            raise jit.OutOfResources(need, limit, "shared memory")
    return launch


def test_a_config_too_big_for_shared_memory_drops_stages_then_halves_its_tile_and_is_remembered(monkeypatch):
    monkeypatch.setattr(jit, "_FITTED", {})
    tiles = {"num_stages": 2, "block_n": 128}
    tried: list[dict] = []
    fit = jit.launch_fitting(fake_gpu(64, tried), tiles, ("block_n", 16), ("head dim 256", "float32"))
    assert fit == {"num_stages": 1, "block_n": 64}
    assert tried == [{"num_stages": 2, "block_n": 128}, {"num_stages": 1, "block_n": 128}, fit]
    tried.clear()  # the next call (a graph capture after its warm-up) launches the fit at once
    assert jit.launch_fitting(fake_gpu(64, tried), tiles, ("block_n", 16), ("head dim 256", "float32")) == fit
    assert tried == [fit]
    tried.clear()  # another kernel, head dim or dtype is its own question
    assert jit.launch_fitting(fake_gpu(1000, tried), tiles, ("block_n", 16), ("head dim 128", "bfloat16")) == tiles
    assert tried == [tiles]


def test_a_launch_that_fits_no_tile_says_so(monkeypatch):
    monkeypatch.setattr(jit, "_FITTED", {})
    with pytest.raises(jit.OutOfResources):
        jit.launch_fitting(fake_gpu(8, []), {"num_stages": 1, "block_n": 32}, ("block_n", 16), ("tiny GPU",))
