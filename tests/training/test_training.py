"""train-target / train-draft: the losses go down, the outputs load, and the drafter decodes losslessly."""

import json
import shutil
from functools import partial

import pytest
import torch
from ddtree.cli import main
from ddtree.core.sampling import SamplingParams
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.models.draft import TargetShape, load_draft
from ddtree.training.corpus import find_files, is_held_out, split_files
from ddtree.training.drafter import STATE_FILE, FrozenTarget, block_batch, parse_taps, train_draft
from ddtree.training.tokenizer import EOS, MASK
from safetensors.torch import load_file
from tiny import HIDDEN, VOCAB, make_dflash2_draft, make_draft
from transformers import AutoTokenizer


def test_target_training_learns_and_saves_a_transformers_checkpoint(tiny_pair):
    root, summary = tiny_pair["root"], tiny_pair["target"]
    assert summary["held_out"]["loss"] < 3.0  # from ~ln(320) = 5.8 at init
    tok = AutoTokenizer.from_pretrained(root / "target")
    assert tok.eos_token == EOS and tok.convert_tokens_to_ids(MASK) != tok.unk_token_id
    assert json.loads((root / "target" / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    text = "def add_3(x, y):\n    return x  # é\n"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_draft_training_reduces_loss_and_writes_a_loadable_z_lab_checkpoint(tiny_pair):
    root, summary = tiny_pair["root"], tiny_pair["draft"]
    assert summary["held_out"]["loss"] < 0.7 * summary["held_out_initial"]["loss"]
    assert summary["held_out"]["tau"] > summary["held_out_initial"]["tau"]
    cfg = json.loads((root / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 6
    assert cfg["is_causal"] is False  # our checkpoints say how they were trained
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 3]  # 'auto' on a 4-layer target
    draft = load_draft(root / "draft", TargetShape(64, 320, 4))
    assert draft.config.mask_token_id == AutoTokenizer.from_pretrained(root / "target").convert_tokens_to_ids(MASK)


def test_dflash2_training_learns_a_selector_and_writes_a_loadable_dflash2_checkpoint(tiny_pair):
    """--arch dflash2 --causal: the backbone, the convolutions and the selector train; the checkpoint is the
    published format (the markers in dflash_config, is_causal, the codebooks without `.weight`)."""
    root, summary = tiny_pair["root"], tiny_pair["draft2"]
    assert summary["architecture"] == "DFlash2DraftModel"
    assert summary["held_out"]["loss"] < 0.7 * summary["held_out_initial"]["loss"]
    assert summary["held_out"]["tau"] > summary["held_out_initial"]["tau"]
    cfg = json.loads((root / "draft2" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is True
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == dict(conv_kernel_size=2, conv_group_size=16,
                                                                            selector_rank=256, selector_top_k=16)
    assert "candidate_selector.successor_codebook" in load_file(str(root / "draft2" / "model.safetensors"))
    draft = load_draft(root / "draft2", TargetShape(64, 320, 4))
    assert draft.config.layer_causal == (True, True)
    assert draft.candidate_selector.successor_codebook.abs().sum() > 0
    assert draft.layers[0].attention_conv.kernel_projection.weight.abs().sum() > 0  # trained from zero


@pytest.mark.parametrize("draft", ["draft", "draft2"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_trained_pair_decodes_losslessly(tiny_pair, method, draft):
    engine = Engine.from_pretrained(tiny_pair["root"] / "target", tiny_pair["root"] / draft, device="cpu")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ("def add_7(x, y):\n", "    total = x"):
        ids = engine.encode(prompt)
        ar = engine.generate(ids, params, method="ar")
        spec = engine.generate(ids, params, method=method, budget=16)
        assert spec.token_ids == ar.token_ids
        assert spec.stats.acceptance_length > 1.0


def test_resume_continues_from_the_saved_step(tiny_pair, tmp_path):
    root = tiny_pair["root"]
    out = tmp_path / "draft"
    shutil.copytree(root / "draft", out)
    before = torch.load(out / STATE_FILE)["step"]
    summary = train_draft(root / "target", tiny_pair["corpus"], out, globs=["*.py"], seq_len=64, blocks=6,
                          batch_size=8, steps=before + 3, device="cpu", resume=True, log=lambda *_: None)
    assert summary["steps"] == before + 3 == torch.load(out / STATE_FILE)["step"]
    assert json.loads((out / "config.json").read_text())["block_size"] == 6  # the checkpoint's, not the default 16


@pytest.mark.parametrize("kind", ["dflash", "dflash2, causal window"])
def test_many_blocks_in_one_forward_match_the_engine_single_block_forward(tmp_path, kind):
    """The training mask gives each block exactly what decoding gives it: context rows < anchor + its block (each
    layer's causality and window on top, and DFlash2's convolutions within each block)."""
    make = make_draft if kind == "dflash" else partial(make_dflash2_draft, is_causal=None, sliding_window=3)
    draft = load_draft(make(tmp_path / "d", block_size=4), TargetShape(HIDDEN, VOCAB, 4))
    torch.manual_seed(0)
    t, n, bs = 24, 3, 4
    ids = torch.randint(0, VOCAB - 2, (2, t))
    block_ids, block_pos, mask, src = block_batch(ids, n, bs, mask_id=VOCAB - 1, generator=torch.Generator())
    assert torch.equal(src, block_pos.view(2, n, bs)[:, :, 1:] - 1)
    feats = torch.randn(2, t, 2 * HIDDEN)
    embeds = torch.randn(2, n * bs, HIDDEN)
    ctx_pos = torch.arange(t).expand(2, t)
    with torch.no_grad():
        together = draft(embeds, block_pos, feats, ctx_pos, mask=mask)
        for b in range(2):
            for j in range(n):
                rows = slice(j * bs, (j + 1) * bs)
                a = int(block_pos[b, j * bs])
                assert int(block_ids[b, j * bs]) == int(ids[b, a]) and (block_ids[b, rows][1:] == VOCAB - 1).all()
                alone = draft(embeds[b:b + 1, rows], block_pos[b:b + 1, rows], feats[b:b + 1, :a], ctx_pos[b:b + 1, :a])
                torch.testing.assert_close(together[b, rows], alone[0], atol=1e-5, rtol=1e-5)


def test_taps():
    assert parse_taps("auto", 36, 5) == [1, 9, 17, 25, 33]  # z-lab's default for Qwen3-8B
    assert parse_taps("auto", 10, 4) == [1, 3, 5, 7]
    assert parse_taps("2,5", 10, 4) == [2, 5]
    with pytest.raises(DDTreeError, match=r"0\.\.9"):
        parse_taps("1,10", 10, 4)


def test_held_out_split_is_by_relative_path_and_skips_nested_installs(tmp_path):
    for root in (tmp_path / "a", tmp_path / "b"):
        (root / "pkg").mkdir(parents=True)
        (root / "site-packages").mkdir()
        (root / "site-packages" / "x.py").write_text("x = 1\n")
        for i in range(200):
            (root / "pkg" / f"m{i}.py").write_text("pass\n")
    split_a, split_b = (split_files(find_files([tmp_path / r], ["*.py"])) for r in ("a", "b"))
    assert [f.relpath for f in split_a[1]] == [f.relpath for f in split_b[1]]
    assert 0 < len(split_a[1]) < 20 and all(is_held_out(f.relpath) for f in split_a[1])
    assert not any("site-packages" in f.relpath for f in split_a[0] + split_a[1])


def test_cli_reports_a_missing_corpus_in_one_line(tiny_pair, capsys, tmp_path):
    rc = main(["train-draft", "--target", str(tiny_pair["root"] / "target"), "--corpus", str(tmp_path / "none"),
               "--out", str(tmp_path / "o"), "--device", "cpu", "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "does not exist" in err and len(err.splitlines()) == 1


def test_taps_are_decoder_layer_outputs(tiny_pair):
    """Tap t is the OUTPUT of layer t, i.e. HF hidden_states[t + 1] (the classic off-by-one)."""
    target = FrozenTarget(tiny_pair["root"] / "target", torch.device("cpu"))
    target.taps = (0, 2)  # not the last layer: HF's last hidden_states entry is post final-norm
    ids = torch.randint(4, 300, (2, 16))
    feats, hidden = target.features(ids)
    with torch.no_grad():
        ref = target.model.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats, torch.cat([ref[1], ref[3]], dim=-1))
    torch.testing.assert_close(hidden, ref[-1])


def test_cli_trains_a_dflash2_drafter_with_its_fields(tiny_pair, tmp_path):
    args = ["train-draft", "--target", str(tiny_pair["root"] / "target"), "--corpus", *tiny_pair["corpus"],
            "--glob", "*.py", "--out", str(tmp_path / "d2"), "--device", "cpu", "--steps", "2", "--layers", "1",
            "--block-size", "4", "--seq-len", "32", "--blocks", "4", "--batch-size", "2", "--eval-every", "100",
            "--arch", "dflash2", "--selector-top-k", "4", "--selector-rank", "8", "--conv-group-size", "32"]
    assert main(args) == 0
    cfg = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert (cfg["dflash_config"]["selector_top_k"], cfg["dflash_config"]["selector_rank"],
            cfg["dflash_config"]["conv_group_size"]) == (4, 8, 32)
    draft = load_draft(tmp_path / "d2", TargetShape(64, 320, 4))
    assert draft.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 2 * 2, 64)
