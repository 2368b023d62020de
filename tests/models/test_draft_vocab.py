"""Draft vocabularies: the drafter proposes only their tokens, and the output stays the target's own."""

import json

import pytest
import torch
from ddtree.cli import main
from ddtree.core.sampling import SamplingParams
from ddtree.core.tree import build_tree
from ddtree.engine import Engine
from ddtree.engine.engine import ASSETS
from ddtree.errors import DDTreeError
from ddtree.models.draft_vocab import DraftHead, count_tokens, load_draft_vocab, most_frequent, write_draft_vocab

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(60, 90))]


def test_the_most_frequent_tokens_come_first_with_stop_tokens_kept_and_ties_to_the_lower_id():
    counts = torch.tensor([0, 5, 2, 5, 0, 9, 1, 0])
    assert most_frequent(counts, 4) == [5, 1, 3, 2]
    assert most_frequent(counts, 4, keep=[7]) == [7, 5, 1, 3]  # a stop token the corpus never shows
    assert most_frequent(counts, 8) == [5, 1, 3, 2, 6, 0, 4, 7]  # uncounted ids fill up, lowest first
    with pytest.raises(DDTreeError, match=r"size must be in 1\.\.8"):
        most_frequent(counts, 9)


def test_counting_tokens_refuses_ids_outside_the_vocabulary():
    assert count_tokens([torch.tensor([1, 1, 3]), torch.tensor([3, 3])], 5).tolist() == [0, 2, 0, 3, 0]
    with pytest.raises(DDTreeError, match=r"\[0, 5\)"):
        count_tokens([torch.tensor([5])], 5)


def test_a_written_vocabulary_loads_back_as_do_plain_lists_and_torch_files(tmp_path):
    write_draft_vocab(tmp_path / "v.json", [7, 2, 40], 96, counted_tokens=10)
    assert load_draft_vocab(tmp_path / "v.json", 96) == [7, 2, 40]
    (tmp_path / "list.json").write_text("[3, 1]")
    assert load_draft_vocab(tmp_path / "list.json", 96) == [3, 1]
    torch.save(torch.tensor([9, 4]), tmp_path / "hot.pt")  # SGLang's hot-token map
    assert load_draft_vocab(tmp_path / "hot.pt", 96) == [9, 4]


@pytest.mark.parametrize(("content", "message"), [
    (None, "does not exist"),
    ("{not json", "is not JSON"),
    ('{"vocab_size": 151936, "token_ids": [1]}', "counted for a vocabulary of 151936 tokens; the target has 96"),
    ("[]", "non-empty list of token ids"),
    ('{"token_ids": "1,2"}', "non-empty list of token ids"),
    ("[1, 96]", r"outside \[0, 96\)"),
    ("[4, 4]", "names a token id twice"),
])
def test_a_bad_vocabulary_file_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "v.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DDTreeError, match=message):
        load_draft_vocab(path, 96)


def test_the_draft_head_scores_its_tokens_with_the_targets_rows():
    head = torch.nn.Linear(8, 10, bias=True)
    sub = DraftHead(head, [7, 2, 5])
    hidden = torch.randn(3, 8)
    assert sub.size == 3 and sub.token_ids.tolist() == [2, 5, 7]  # ascending: ties still go to the lower id
    assert torch.allclose(sub(hidden), head(hidden)[:, [2, 5, 7]])
    assert sub.tokens(torch.tensor([[0, 2]])).tolist() == [[2, 7]]
    whole = DraftHead(head, None)
    assert whole.token_ids is None and whole.weight is not None and whole.size == 10


def test_a_tree_over_a_draft_vocabulary_is_the_tree_of_its_columns_in_token_ids():
    logits = torch.randn(6, 50) * 3
    ids = torch.tensor(sorted(torch.randperm(96)[:50].tolist()))
    tree = build_tree(logits, 20, token_ids=ids)
    plain = build_tree(logits, 20)
    assert tree.tokens == [int(ids[t]) for t in plain.tokens] and tree.parents == plain.parents
    assert set(tree.tokens) <= set(ids.tolist())


def test_greedy_output_with_a_draft_vocabulary_is_the_targets_own(engines):
    engine = engines["qwen3"]
    hot = list(range(0, 96, 2))
    sub = Engine(engine.target, engine.draft, draft_vocab=hot)
    for prompt in PROMPTS:
        want = engine.generate(prompt, GREEDY, method="ar").token_ids
        for method, budget in (("dflash", None), ("ddtree", 8), ("ddtree", 40)):
            assert sub.generate(prompt, GREEDY, method=method, budget=budget).token_ids == want


def test_tokens_outside_the_draft_vocabulary_are_never_drafted_but_still_emitted(engines):
    engine = engines["qwen3"]
    prompt = PROMPTS[1]
    want = engine.generate(prompt, GREEDY, method="ar").token_ids
    # Every token ar emits after the first is left out: no draft node can match, so each round emits only
    # its bonus token (the target's own pick), and the output is unchanged.
    hot = sorted(set(range(96)) - set(want[1:]))
    got = Engine(engine.target, engine.draft, draft_vocab=hot).generate(prompt, GREEDY, method="ddtree", budget=16)
    assert got.token_ids == want
    assert got.stats.acceptance_length == 1.0
    full = engine.generate(prompt, GREEDY, method="ddtree", budget=16)
    assert full.stats.acceptance_length > 1.0


def test_ddtree_draft_vocab_writes_a_file_generate_and_the_server_read(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"m{i}.py").write_text("def add(a, b):\n    return a + b\n" * (20 + i))
    out = tmp_path / "hot.json"
    assert main(["draft-vocab", "--target", str(ASSETS / "target"), "--corpus", str(corpus), "--size", "300",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "300 of 8192 tokens" in err and "100.0% of the" in err  # the corpus uses only a few tokens
    written = json.loads(out.read_text())
    assert written["vocab_size"] == 8192 and written["counted_files"] == 3 and len(written["token_ids"]) == 300
    engine = Engine.from_pretrained(draft_vocab=out, device="cpu")
    assert engine.draft_head.size == 300 and 0 in written["token_ids"]  # the demo's EOS
    prompt = engine.encode("def add(a, b):\n")
    ids = engine.generate(prompt, GREEDY, method="ddtree").token_ids
    assert ids == Engine.from_pretrained(device="cpu").generate(prompt, GREEDY, method="ar").token_ids


def test_a_bad_draft_vocab_flag_is_one_line_without_traceback(tmp_path, capsys):
    (tmp_path / "v.json").write_text("[1, 99999]")
    code = main(["generate", "--prompt", "x", "--draft-vocab", str(tmp_path / "v.json"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].endswith("holds token ids outside [0, 8192)")
    (tmp_path / "v.json").write_text("[1, 1]")  # what needs no model fails before any loads
    code = main(["generate", "--prompt", "x", "--draft-vocab", str(tmp_path / "v.json"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "names a token id twice" in err
    code = main(["draft-vocab", "--target", str(ASSETS / "target"), "--corpus", str(tmp_path / "none"),
                 "--out", str(tmp_path / "o.json")])
    assert code == 2 and "does not exist" in capsys.readouterr().err
