"""Drafters are drafted by the published rules: the causality rule, the 2026 config fields, DFlash2's modules.

Each layout's draft outputs, on the reference path and on the fast path, equal a plain-PyTorch dense reading of
the rules (tests/dense_draft.py, float64, sharing no code with ddtree) to float32 rounding: DFlash's logits
(old and new layouts, a sliding/full mix, `is_causal` true and false, windows smaller than the block, softcap
and output multiplier, embedding scale, attention sinks) and DFlash2's convolutions, transition model and
greedy selector chain. The loader says which rule it applied to each layer and refuses inconsistent checkpoints
in one line; every drafter kind decodes to the target's own greedy tokens.
"""

import json
import logging

import pytest
import torch
from ddtree.core.sampling import SamplingParams
from ddtree.core.tree import Transitions, selector_chain
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.models.draft import DraftCache, TargetShape, load_draft
from dense_draft import DenseDraft
from safetensors.torch import load_file, save_file
from tiny import HIDDEN, VOCAB, make_dflash2_draft, make_draft

TARGET = TargetShape(hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=4)
PROMPT = list(range(10, 30))
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)

DFLASH = {
    "old": dict(),
    "new, sliding + full": dict(layout="new", sliding_window=5),
    "window inside the block": dict(sliding_window=3),
    "is_causal true": dict(sliding_window=3, is_causal=True),
    "is_causal false, symmetric window": dict(layout="new", sliding_window=3, is_causal=False),
    "is_causal in dflash_config": dict(fields={"is_causal": True}),
    "softcap and multiplier": dict(fields={"output_multiplier": 1.7, "final_logit_softcapping": 2.5}),
    "embedding scale": dict(fields={"input_embedding_scale": 3.0}),
    "sinks": dict(sinks="sinks"),
    "sinks, other exporter's name": dict(sinks="attention_sink_bias", sliding_window=4),
}
DFLASH2 = {
    "dflash2": dict(),
    "dflash2, causal sliding layers": dict(is_causal=None, sliding_window=3),
    "dflash2, softcap and embedding scale": dict(fields={"final_logit_softcapping": 3.0,
                                                         "input_embedding_scale": 0.5}),
}
LAYOUTS = {**{name: (make_draft, kw) for name, kw in DFLASH.items()},
           **{name: (make_dflash2_draft, kw) for name, kw in DFLASH2.items()}}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("drafts")
    return {name: make(root / name.replace(" ", "_").replace(",", ""), seed=i + 20, **kw)
            for i, (name, (make, kw)) in enumerate(LAYOUTS.items())}


@pytest.fixture(scope="module")
def engines(ckpt, drafts) -> dict[str, tuple[Engine, Engine]]:
    """layout -> (reference engine, fast engine) over the same tiny Qwen3 target and draft."""
    out = {}
    for name, path in drafts.items():
        reference = Engine.from_pretrained(ckpt / "qwen3", path, device="cpu")
        out[name] = reference, Engine(reference.target, reference.draft, reference.tokenizer, fast=True,
                                      fast_capacity=128)
    return out


def first_block(reference: Engine, fast: Engine, path) -> tuple[int, torch.Tensor, DenseDraft, object, object]:
    """The prompt's root and context features, the dense oracle, and the first block's draft output on the
    reference path and on the fast path."""
    target = reference.target
    with torch.inference_mode():
        logits, taps = target.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), target.new_cache())
        root = int(logits[-1].argmax())
        cache = DraftCache(reference.draft.config.num_layers)
        reference.draft.extend_context(cache, taps[None], torch.arange(len(PROMPT))[None])
        ref = reference.reference._draft(root, len(PROMPT), cache)
        assert fast.fast.prefill(torch.tensor(PROMPT), with_draft=True)[0] == root
        got = fast.fast.draft_logits()
    dense = DenseDraft(path, target.embed_tokens.weight.detach(), target.lm_head.weight.detach())
    return root, taps.detach(), dense, ref, got


@pytest.mark.parametrize("layout", list(DFLASH))
def test_dflash_logits_equal_the_dense_rules_on_both_paths(engines, drafts, layout):
    reference, fast = engines[layout]
    root, taps, dense, ref, got = first_block(reference, fast, drafts[layout])
    want = dense.logits(root, len(PROMPT), taps)
    for name, logits in (("reference", ref), ("fast", got)):
        assert logits.shape == want.shape
        assert torch.allclose(logits.double(), want, atol=2e-5, rtol=1e-5), (name, (logits.double() - want).abs().max())


def test_the_causality_rule_changes_the_draft():
    """The rule is not a no-op on these fixtures: drafting a sliding layer bidirectionally gives other logits."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        causal = DenseDraft(make_draft(Path(tmp) / "a", sliding_window=3), torch.randn(VOCAB, HIDDEN),
                            torch.randn(VOCAB, HIDDEN))
        ctx = torch.randn(12, 2 * HIDDEN)
        want = causal.logits(5, 12, ctx)
        causal.causal = [False, False]
        assert not torch.allclose(causal.logits(5, 12, ctx), want, atol=1e-3)


@pytest.mark.parametrize("layout", list(DFLASH2))
def test_dflash2_transitions_and_chain_equal_the_dense_rules_on_both_paths(engines, drafts, layout):
    reference, fast = engines[layout]
    root, taps, dense, ref, got = first_block(reference, fast, drafts[layout])
    want_logp, want_tokens = dense.transitions(root, len(PROMPT), taps)
    assert isinstance(ref, Transitions) and torch.equal(ref.tokens, want_tokens)
    ordered, order, tokens = got  # the fast path's rows, sorted best first
    assert torch.equal(tokens, want_tokens)
    for logp in (ref.logp, torch.empty_like(ordered).scatter_(-1, order, ordered)):
        assert torch.allclose(logp.double(), want_logp, atol=2e-5, rtol=1e-5), (logp.double() - want_logp).abs().max()
    chain = dense.chain(root, len(PROMPT), taps)
    assert selector_chain(ref) == chain
    assert fast.fast.fused_draft.tree_step("dflash", 0, None)(got)[0].tolist() == chain


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_decodes_to_the_targets_tokens_with_the_same_rounds_on_both_paths(engines, layout):
    reference, fast = engines[layout]
    ar = reference.generate(PROMPT, GREEDY, method="ar").token_ids
    for method, budget in (("dflash", None), ("ddtree", 6), ("ddtree", 40)):
        ref = reference.stream(PROMPT, GREEDY, method=method, budget=budget)
        ref_rounds = list(ref)
        gen = fast.stream(PROMPT, GREEDY, method=method, budget=budget)
        rounds = list(gen)
        assert gen.backend.name == "fast" and ref.token_ids == gen.token_ids == ar, (method, budget)
        assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds], (method, budget)
        assert [r.draft_nodes for r in rounds] == [r.draft_nodes for r in ref_rounds], (method, budget)


def test_loader_logs_the_rule_it_applied_to_each_layer(drafts, caplog):
    cases = {"old": "layers by layer types (no is_causal) (0: bidirectional, 1: bidirectional)",
             "new, sliding + full": "layers by layer types (no is_causal) (0: causal window 5, 1: bidirectional)",
             "is_causal true": "layers by is_causal=true (0: causal window 3, 1: causal)",
             "is_causal false, symmetric window": "layers by is_causal=false (0: bidirectional window 3, "
                                                  "1: bidirectional)",
             "dflash2": "DFlash2DraftModel, block 8, layers by is_causal=false"}
    for name, line in cases.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ddtree.draft"):
            load_draft(drafts[name], TARGET)
        assert [r.getMessage() for r in caplog.records if line in r.getMessage()], (name, caplog.text)


def test_dflash2_codebooks_are_stored_without_weight_and_either_spelling_loads(drafts, tmp_path):
    path = drafts["dflash2"]
    keys = set(load_file(str(path / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= keys
    assert "candidate_selector.predecessor_codebook.weight" not in keys
    want = load_draft(path, TARGET)
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in tensors.items()}
    copy = tmp_path / "d"
    copy.mkdir()
    (copy / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(copy / "model.safetensors"))
    got = load_draft(copy, TARGET)
    assert torch.equal(got.candidate_selector.successor_codebook, want.candidate_selector.successor_codebook)


def rewrite(path, config=None, drop=(), rename=None):
    """Edit a checkpoint in place: config changes (None values delete a key; dotted keys for dflash_config),
    tensors dropped or renamed."""
    cfg = json.loads((path / "config.json").read_text())
    for key, value in (config or {}).items():
        where, key = (cfg["dflash_config"], key[3:]) if key.startswith("dc.") else (cfg, key)
        if value is None:
            where.pop(key, None)
        else:
            where[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {(rename or {}).get(k, k): v for k, v in load_file(str(path / "model.safetensors")).items()
               if not any(k.startswith(d) for d in drop)}
    save_file(tensors, str(path / "model.safetensors"))


MARKERS = {f"dc.{k}": None for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}


@pytest.mark.parametrize(("dflash2", "edit", "message"), [
    (False, dict(config={"dc.conv_kernel_size": 2}),
     "inconsistent: a DFlashDraftModel config with DFlash2 fields (conv_kernel_size)"),
    (True, dict(config=MARKERS), "DFlash2 config without dflash_config.conv_kernel_size"),
    (True, dict(config={"architectures": ["DFlashDraftModel"], **MARKERS}),
     "DFlash2 tensors, but the config is not a DFlash2 one: inconsistent checkpoint"),
    (True, dict(drop=("candidate_selector.successor_codebook",)),
     "missing tensor(s) candidate_selector.successor_codebook"),
    (True, dict(config={"dc.conv_group_size": 24}), "conv_group_size 24 does not divide hidden_size 64"),
    (True, dict(config={"dc.selector_top_k": VOCAB + 1}), f"selector_top_k {VOCAB + 1} exceeds the vocabulary"),
    (False, dict(config={"is_causal": True, "dc.is_causal": False}),
     "inconsistent is_causal: True at the top level, False in dflash_config"),
    (False, dict(config={"is_causal": "yes"}), "is_causal must be true or false, got 'yes'"),
    (False, dict(config={"attention_sink_bias": True}), "missing tensor(s) layers.0.self_attn.sinks"),
    (False, dict(config={"layer_types": ["sliding_attention", "chunked_attention"]}),
     "unknown layer type(s) chunked_attention"),
    (False, dict(config={"dc.final_logit_softcapping": -1}), "final_logit_softcapping must be >= 0"),
    (False, dict(config={"dc.output_multiplier": "2"}), "output_multiplier must be a finite number"),
])
def test_inconsistent_checkpoints_are_refused_in_one_clear_line(tmp_path, dflash2, edit, message):
    path = (make_dflash2_draft if dflash2 else make_draft)(tmp_path / "d")
    rewrite(path, **edit)
    with pytest.raises(DDTreeError) as err:
        load_draft(path, TARGET)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_sink_tensors_without_the_config_flag_are_refused(tmp_path):
    path = make_draft(tmp_path / "d", sinks="sinks")
    rewrite(path, config={"attention_sink_bias": None})
    with pytest.raises(DDTreeError, match="attention sinks, but the config does not set attention_sink_bias"):
        load_draft(path, TARGET)


def test_generate_says_how_each_draft_layer_is_drafted(ckpt, drafts, capsys):
    from ddtree.cli import main

    args = ["generate", "--target", str(ckpt / "qwen3"), "--draft", str(drafts["new, sliding + full"]),
            "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--device", "cpu"]
    assert main(args) == 0
    assert ("ddtree generate: draft: DFlashDraftModel, block 8, layers by layer types (no is_causal) "
            "(0: causal window 5, 1: bidirectional)") in capsys.readouterr().err.splitlines()


def test_a_dflash2_drafter_with_a_draft_vocabulary_maps_its_candidates_to_token_ids(engines):
    """The selector's candidates are draft-logit columns mapped to token ids before the codebooks read them: the
    same trees on both paths, and only tokens of the vocabulary drafted."""
    reference, _ = engines["dflash2"]
    hot = list(range(1, VOCAB, 3))
    sub_ref = Engine(reference.target, reference.draft, reference.tokenizer, draft_vocab=hot)
    sub_fast = Engine(reference.target, reference.draft, reference.tokenizer, fast=True, fast_capacity=128,
                      draft_vocab=hot)
    ar = reference.generate(PROMPT, GREEDY, method="ar").token_ids
    with torch.inference_mode():
        sub_fast.fast.prefill(torch.tensor(PROMPT), with_draft=True)
        assert set(sub_fast.fast.draft_logits()[2].flatten().tolist()) <= set(hot)
    for method, budget in (("dflash", None), ("ddtree", 12)):
        ref = sub_ref.stream(PROMPT, GREEDY, method=method, budget=budget)
        ref_rounds = list(ref)
        gen = sub_fast.stream(PROMPT, GREEDY, method=method, budget=budget)
        rounds = list(gen)
        assert gen.backend.name == "fast" and gen.token_ids == ref.token_ids == ar, method
        assert [r.accepted for r in rounds] == [r.accepted for r in ref_rounds], method
