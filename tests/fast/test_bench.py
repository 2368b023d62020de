"""`ddtree bench` and `ddtree generate --fast` as a user runs them (in-process, tiny models, CPU)."""

import json

from ddtree.cli import main


def test_bench_reports_every_run_and_phase_and_agrees_with_ar(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar", "ddtree", "--budgets", "4", "16",
               "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "10", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    runs = [(r["path"], r["method"], r["budget"]) for r in report["results"]]
    assert runs == [(p, m, b) for p in ("fast", "eager") for m, b in (("ar", None), ("ddtree", 4), ("ddtree", 16))]
    for r in report["results"]:
        assert r["lossless"] and r["prefix_match"] == 1.0
        assert r["on_fast_path"] == (r["path"] == "fast")
        assert set(r["phase_ms"]) >= {"tree", "verify", "commit", "host"}
        assert r["round_ms"] > 0 and r["tokens_per_second"] > 0 and r["tau"] >= 1
        assert r["round_vs_ar_step"] > 0 and 0 <= r["non_verify_share"] < 1
    assert report["fast_vs_eager_ar_prefix_match"] == 1.0
    assert report["step_bytes"] > 0 and report["floor_ms"]["spec"] > 0
    table = capsys.readouterr().out
    assert table.count("| fast |") == 3 and table.count("| eager |") == 3


def test_bench_rejects_an_unknown_shape(capsys):
    assert main(["bench", "--shape", "qwen9-1t", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_generate_fast_gives_the_reference_tokens(fast_ckpt, capsys):
    args = ["generate", "--target", str(fast_ckpt / "llama"), "--draft", str(fast_ckpt / "draft"), "--prompt-ids",
            "1,2,3", "--max-new-tokens", "12", "--device", "cpu", "--json"]
    outputs = []
    for extra in ([], ["--fast"]):
        assert main(args + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12
