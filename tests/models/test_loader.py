"""The draft loader accepts both z-lab layouts and refuses mismatched or foreign checkpoints clearly; damaged
checkpoints (truncated, corrupt, missing shards, wrong dtypes) fail in one line before anything loads."""

import json
from pathlib import Path

import pytest
import torch
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.models.checkpoint import CheckpointError
from ddtree.models.draft import DraftCache, TargetShape, default_taps, load_draft
from ddtree.models.target import load_target
from safetensors.torch import load_file, save_file
from tiny import HIDDEN, VOCAB, make_draft, make_target, target_config
from transformers import AutoModelForCausalLM

TARGET = TargetShape(hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=4)


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_default_taps_match_the_published_drafts():
    assert default_taps(36, 5) == [1, 9, 17, 25, 33]
    assert default_taps(64, 5) == [1, 16, 31, 46, 61]
    assert default_taps(48, 8) == [1, 7, 14, 20, 26, 32, 39, 45]
    assert default_taps(32, 1) == [16]


def test_both_layouts_load_with_their_fields(tmp_path):
    old = load_draft(make_draft(tmp_path / "old"), TARGET)
    new = load_draft(make_draft(tmp_path / "new", layout="new", sliding_window=5), TARGET)
    for model in (old, new):
        assert (model.config.block_size, model.config.mask_token_id) == (8, VOCAB - 1)
        assert model.config.target_layer_ids == tuple(default_taps(4, 2))
    assert old.config.layer_windows == (None, None)
    assert new.config.layer_windows == (5, None)
    assert old.config.layer_causal == (False, False) and new.config.layer_causal == (True, False)  # no is_causal
    keys = set(load_file(str(tmp_path / "old" / "model.safetensors")))
    assert len(keys) == 11 * 2 + 3 and {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys


def test_model_prefix_and_borrowed_tensors_are_tolerated(tmp_path):
    d = make_draft(tmp_path / "d")
    tensors = load_file(str(d / "model.safetensors"))
    reference = load_draft(d, TARGET)
    tensors = {f"model.{k}": v for k, v in tensors.items()}
    tensors["embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)
    save_file(tensors, str(d / "model.safetensors"))
    loaded = load_draft(d, TARGET)
    torch.testing.assert_close(loaded.fc.weight, reference.fc.weight)


def test_sliding_window_hides_keys_at_or_beyond_the_window(tmp_path):
    """A causal sliding layer sees keys at 0 <= q - k < window; a bidirectional one |q - k| < window (HF)."""
    q = torch.tensor([[10, 11]])
    k = torch.tensor([[6, 7, 8, 9, 10, 11]])
    causal = load_draft(make_draft(tmp_path / "c", sliding_window=3), TARGET)._layer_masks(q, k, None)
    assert causal[None, False] is None  # the full-attention layer: no mask at all
    assert causal[3, True][0, 0].int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    both = load_draft(make_draft(tmp_path / "b", sliding_window=3, is_causal=False), TARGET)._layer_masks(q, k, None)
    assert both[3, False][0, 0].int().tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]


def test_cached_context_equals_full_context(tmp_path):
    model = load_draft(make_draft(tmp_path / "d", sliding_window=4), TARGET)
    torch.manual_seed(0)
    feats = torch.randn(1, 9, 2 * HIDDEN)
    block = torch.randn(1, 8, HIDDEN)
    block_pos = torch.arange(9, 17)[None]
    cache = DraftCache(2)
    model.extend_context(cache, feats[:, :5], torch.arange(5)[None])
    model.extend_context(cache, feats[:, 5:], torch.arange(5, 9)[None])
    with torch.no_grad():
        cached = model(block, block_pos, cache=cache)
        full = model(block, block_pos, feats, torch.arange(9)[None])
    torch.testing.assert_close(cached, full)


@pytest.mark.parametrize("change,message", [
    (dict(hidden_size=HIDDEN * 2), "hidden_size 128 does not match the target's 64"),
    (dict(vocab_size=VOCAB + 1), f"vocab_size {VOCAB + 1} does not match the target's {VOCAB}"),
    (dict(num_target_layers=36), "trained for a 36-layer target, but the target has 4 layers"),
    (dict(dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 4]}),
     "target_layer_ids [1, 4] out of range for a 4-layer target"),
    (dict(dflash_config={"mask_token_id": VOCAB, "target_layer_ids": [1, 2]}),
     f"mask_token_id {VOCAB} is outside the target embedding ({VOCAB} rows)"),
    (dict(block_size=None), "no block_size (top level or dflash_config)"),
    (dict(intermediate_size=None), "missing required field(s) intermediate_size"),
    (dict(conv_kernel_size=4), "inconsistent: a DFlashDraftModel config with DFlash2 fields (conv_kernel_size)"),
    (dict(architectures=["DFlash2DraftModel"]), "DFlash2 config without dflash_config.conv_kernel_size"),
    (dict(architectures=["Qwen3ForCausalLM"], dflash_config=None), "not a DFlash draft"),
])
def test_config_errors_are_one_clear_line(tmp_path, change, message):
    d = make_draft(tmp_path / "d")
    edit_config(d, **change)
    with pytest.raises(DDTreeError) as err:
        load_draft(d, TARGET)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_tensor_and_missing_files(tmp_path):
    d = make_draft(tmp_path / "d")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(DDTreeError, match=r"missing tensor\(s\) fc.weight"):
        load_draft(d, TARGET)
    with pytest.raises(DDTreeError, match="does not exist"):
        load_draft(tmp_path / "nowhere", TARGET)
    (d / "config.json").unlink()
    with pytest.raises(DDTreeError, match=r"has no config\.json"):
        load_draft(d, TARGET)


def test_engine_refuses_a_draft_as_target_and_a_mismatched_pair(ckpt, tmp_path):
    with pytest.raises(DDTreeError, match="is a DFlash draft, not a target"):
        Engine.from_pretrained(ckpt / "draft", ckpt / "draft", device="cpu")
    make_draft(tmp_path / "deep", target_layers=8, taps=[1, 5])
    with pytest.raises(DDTreeError, match=r"trained for a 8-layer target"):
        Engine.from_pretrained(ckpt / "qwen3", tmp_path / "deep", device="cpu")
    with pytest.raises(DDTreeError, match="needs a DFlash draft"):
        Engine.from_pretrained(ckpt / "qwen3", None, method="ddtree", device="cpu")


def damage(weights: Path, how: str) -> None:
    """What interrupted pulls, full disks and bad conversions leave behind."""
    data = weights.read_bytes()
    if how == "truncated":
        weights.write_bytes(data[:len(data) // 2])
    elif how == "corrupt header":
        weights.write_bytes(data[:8] + b"\x00garbage" + data[16:])
    elif how == "dtype":  # the header says F16 where the bytes are F32
        weights.write_bytes(data.replace(b'"F32"', b'"F16"', 1))
    elif how == "integer weights":
        tensors = load_file(str(weights))
        tensors["fc.weight"] = tensors["fc.weight"].to(torch.int32)
        save_file(tensors, str(weights))
    elif how == "empty":
        weights.write_bytes(b"")


DAMAGE = [("truncated", "is truncated"), ("corrupt header", "corrupt header"),
          ("dtype", "the header gives it"), ("integer weights", "is I32, not a float dtype"),
          ("empty", "not a safetensors file or is truncated (0 bytes)")]


@pytest.mark.parametrize("how,message", DAMAGE)
def test_a_damaged_draft_fails_in_one_line(tmp_path, how, message):
    d = make_draft(tmp_path / "d")
    damage(d / "model.safetensors", how)
    with pytest.raises(CheckpointError) as err:
        load_draft(d, TARGET)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("how,message", [item for item in DAMAGE if item[0] != "integer weights"])
def test_a_damaged_target_fails_in_one_line(tmp_path, how, message):
    t = make_target(tmp_path / "t")
    damage(t / "model.safetensors", how)
    with pytest.raises(CheckpointError) as err:
        load_target(t, device=torch.device("cpu"), dtype=torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_sharded_target_needs_every_shard(tmp_path):
    t = tmp_path / "t"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(target_config(), dtype=torch.float32).save_pretrained(t, max_shard_size="100KB")
    shards = sorted(t.glob("model-*.safetensors"))
    assert len(shards) > 2 and (t / "model.safetensors.index.json").is_file()
    assert load_target(t, device=torch.device("cpu"), dtype=torch.float32).shape.vocab_size == VOCAB
    damage(shards[1], "truncated")
    with pytest.raises(CheckpointError, match=f"{shards[1].name} is truncated"):
        load_target(t, device=torch.device("cpu"), dtype=torch.float32)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard {shards[1].name} listed in model.safetensors.index.json is "
                       "missing"):
        load_target(t, device=torch.device("cpu"), dtype=torch.float32)
