"""`ddtree bench` and `ddtree generate --fast` as a user runs them (in-process, tiny models, CPU)."""

import json

import pytest
import torch
from ddtree.cli import main
from ddtree.engine import Engine


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
        assert r["warmup_s"] > 0  # the plan's first generation (captures, compiles), timed on its own
    assert report["fast_vs_eager_ar_prefix_match"] == 1.0
    assert report["step_bytes"] > 0 and report["floor_ms"]["spec"] > 0
    assert report["dtype"] == "float32"  # the CPU default; --dtype picks another
    table = capsys.readouterr().out
    assert table.count("| fast |") == 3 and table.count("| eager |") == 3


def test_a_sampled_bench_runs_the_filters_on_the_fast_path_and_compares_speed_not_tokens(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar", "ddtree", "--budgets", "8",
               "--prompts", "2", "--prompt-tokens", "12", "--max-new-tokens", "10", "--temperature", "0.8",
               "--top-p", "0.9", "--top-k", "20", "--seed", "7", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["sampling"] == "sampled at temperature 0.8, top-k 20, top-p 0.9, seed 7"
    fast = [r for r in report["results"] if r["path"] == "fast"]
    assert [r["on_fast_path"] for r in fast] == [True, True] and all(r["graphs"] for r in fast)
    for r in report["results"]:
        assert r["lossless"] is None and r["prefix_match"] is None  # samples differ by design
        assert r["tau"] >= 1 and r["tokens_per_second"] > 0
    assert "fast_vs_eager_ar_prefix_match" not in report
    assert "sampled at temperature 0.8" in capsys.readouterr().out


def test_a_penalized_bench_with_logprobs_stays_on_the_fast_path_and_agrees_with_ar(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar", "ddtree", "--budgets", "8",
               "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "10", "--presence-penalty", "0.5",
               "--repetition-penalty", "1.2", "--logprobs", "2", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["sampling"] == "greedy, presence penalty 0.5, repetition penalty 1.2, logprobs 2"
    fast = [r for r in report["results"] if r["path"] == "fast"]
    assert [r["on_fast_path"] for r in fast] == [True, True] and all(r["graphs"] for r in fast)
    assert all(r["lossless"] for r in report["results"])  # greedy: every method still gives ar's tokens


def test_bench_rejects_bad_sampling_settings_without_a_traceback(capsys):
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--temperature", "1", "--top-p", "0"]) == 2
    err = capsys.readouterr().err
    assert "top_p must be in (0, 1]" in err and "Traceback" not in err


def test_bench_rejects_an_unknown_shape(capsys):
    assert main(["bench", "--shape", "qwen9-1t", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_bench_runs_a_hybrid_shape_on_the_fast_path_and_agrees_with_the_eager_path(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny-hybrid", "--device", "cpu", "--methods", "ar", "dflash", "ddtree",
               "--budgets", "8", "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "10",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["fast_path"] == "available"
    assert [(r["path"], r["method"]) for r in report["results"]] == [
        (p, m) for p in ("fast", "eager") for m in ("ar", "dflash", "ddtree")]
    assert all(r["lossless"] and r["on_fast_path"] == (r["path"] == "fast") for r in report["results"])
    assert report["fast_vs_eager_ar_prefix_match"] == 1.0


def test_weight_bytes_counts_attention_kv_and_gated_deltanet_state():
    from ddtree.bench.shapes import build_shape
    from ddtree.bench.timing import weight_bytes
    from ddtree.models.shapes import SHAPES

    fast, _ = build_shape("tiny-hybrid", "cpu", torch.float32, fast_capacity=64)
    t = SHAPES["tiny-hybrid"]["target"]
    params = sum(p.numel() for p in fast.target.model.parameters()) - t["vocab_size"] * t["hidden_size"]
    kv_per_token = 2 * 1 * 2 * 16 * 4  # K and V x 1 attention layer x 2 kv heads x head_dim 16 x fp32
    recurrent = 4 * 16 * 16 * 4  # value heads x key dim x value dim, fp32
    conv = (2 * 2 * 16 + 4 * 16) * 3 * 4  # (q, k, v channels) x (kernel - 1) x fp32
    assert weight_bytes(fast, 100) == 4 * params + 100 * kv_per_token + 2 * 3 * (recurrent + conv)


def test_a_rounds_floor_adds_the_draft_its_commit_and_the_lm_head_to_the_target_step(tmp_path):
    """The draft's bytes: its parameters, its K/V projections again (the commit), the LM head, its context K/V;
    the report's round floor and draft share follow from them, and every run is timed against its floor."""
    from ddtree.bench.shapes import build_shape
    from ddtree.bench.timing import draft_bytes, weight_bytes
    from ddtree.models.shapes import SHAPES

    fast, _ = build_shape("tiny", "cpu", torch.float32, fast_capacity=64)
    t, d = SHAPES["tiny"]["target"], SHAPES["tiny"]["draft"]
    hidden, kv_width = t["hidden_size"], d["num_kv_heads"] * d["head_dim"]
    layer = (hidden * d["num_heads"] * d["head_dim"] * 2 + hidden * kv_width * 2 + 3 * hidden * d["intermediate_size"]
             + 2 * hidden + 2 * d["head_dim"])  # q, o, k, v, the MLP, two norms, q/k norms
    params = len(d["target_layer_ids"]) * hidden * hidden + hidden + d["num_layers"] * layer + hidden  # fc, norms
    again = d["num_layers"] * 2 * hidden * kv_width
    head = t["vocab_size"] * hidden
    context_kv = 2 * d["num_layers"] * kv_width * 100
    assert draft_bytes(fast, 100) == 4 * (params + again + head + context_kv)

    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar", "dflash", "--paths", "fast",
                 "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    step, draft = weight_bytes(fast, 16), draft_bytes(fast, 16)  # context: the prompt and half the new tokens
    assert report["step_bytes"] == step and report["round_bytes"] == step + draft
    assert report["draft_share_of_round_floor"] == pytest.approx(draft / (step + draft))
    assert report["round_vs_floor_at"] == "spec"  # no bandwidth measured on a CPU
    assert report["copy_bandwidth"] is None and report["read_bandwidth"] is None
    ar, dflash = report["results"]
    assert ar["round_vs_floor"] == pytest.approx(ar["round_ms"] / report["floor_ms"]["spec"])
    assert dflash["round_vs_floor"] == pytest.approx(dflash["round_ms"] / report["round_floor_ms"]["spec"])


def test_a_draft_vocabulary_bench_counts_only_its_lm_head_rows_and_agrees_with_ar(tmp_path, capsys):
    from ddtree.bench.shapes import build_shape
    from ddtree.bench.timing import draft_bytes
    from ddtree.models.shapes import SHAPES

    whole, _ = build_shape("tiny", "cpu", torch.float32, fast_capacity=64)
    sub, eager = build_shape("tiny", "cpu", torch.float32, fast_capacity=64, draft_vocab="100")
    assert eager.draft_head is sub.draft_head  # one copy of the rows serves both paths
    vocab, hidden = SHAPES["tiny"]["target"]["vocab_size"], SHAPES["tiny"]["target"]["hidden_size"]
    assert draft_bytes(whole, 10) - draft_bytes(sub, 10) == 4 * (vocab - 100) * hidden
    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar", "dflash", "ddtree", "--budgets",
                 "16", "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "12", "--draft-vocab", "100",
                 "--json", str(out)]) == 0
    assert "The draft scores 100 tokens" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["draft_vocab"], report["vocab_size"]) == (100, vocab)
    assert all(r["lossless"] for r in report["results"])
    assert all(r["on_fast_path"] for r in report["results"] if r["path"] == "fast")
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--draft-vocab", str(vocab + 1)]) == 2
    assert f"--draft-vocab must be in 1..{vocab} tokens" in capsys.readouterr().err


def test_an_fp8_draft_bench_counts_a_byte_per_weight_plus_its_scales_and_agrees_with_ar(tmp_path, capsys):
    """Every draft projection and the head's rows in fp8 (one byte each, one float32 scale per row); the norms and
    the draft's context K/V keep the model's dtype (float32 here)."""
    from ddtree.bench.shapes import build_shape
    from ddtree.bench.timing import draft_bytes
    from ddtree.models.shapes import SHAPES

    plain, _ = build_shape("tiny", "cpu", torch.float32, fast_capacity=64)
    fp8, eager = build_shape("tiny", "cpu", torch.float32, fast_capacity=64, draft_quantization="fp8")
    assert eager.draft is fp8.draft and eager.draft_head is fp8.draft_head
    t, d = SHAPES["tiny"]["target"], SHAPES["tiny"]["draft"]
    hidden, kv_width = t["hidden_size"], d["num_kv_heads"] * d["head_dim"]
    q_width, inter = d["num_heads"] * d["head_dim"], d["intermediate_size"]
    layer_rows = 2 * q_width + hidden + 2 * kv_width + 2 * inter  # output rows: q, o's, k, v, gate, up, down's
    layer_values = 2 * hidden * q_width + 2 * hidden * kv_width + 3 * hidden * inter
    taps = len(d["target_layer_ids"])
    values = taps * hidden * hidden + d["num_layers"] * layer_values
    rows = hidden + d["num_layers"] * layer_rows  # fc's, then the layers'
    norms = 4 * (2 * hidden + d["num_layers"] * (2 * hidden + 2 * d["head_dim"]))
    again = d["num_layers"] * 2 * (hidden * kv_width + 4 * kv_width)
    head = t["vocab_size"] * (hidden + 4)
    context_kv = 4 * 2 * d["num_layers"] * kv_width * 10
    assert draft_bytes(fp8, 10) == values + 4 * rows + norms + again + head + context_kv
    assert draft_bytes(fp8, 10) < draft_bytes(plain, 10) / 3
    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar", "ddtree", "--budgets", "16",
                 "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "12", "--draft-quantization", "fp8",
                 "--json", str(out)]) == 0
    assert "The draft runs in fp8" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["draft_quantization"] == "fp8" and all(r["lossless"] for r in report["results"])


def test_runs_are_timed_against_the_best_measured_read_bandwidth(tmp_path, monkeypatch):
    """Where the device's copy and read bandwidth are measured (before and after the runs), the floors at both
    are reported, and each run's round/floor is against the best read bandwidth: the tightest floor."""
    from ddtree.bench import command as bench
    from ddtree.bench.timing import SPEC_BANDWIDTH

    measured = iter([(3.9e12, 4.6e12), (4.2e12, 4.5e12)])  # before the runs, after them
    monkeypatch.setattr(bench, "measured_ceilings", lambda device: next(measured))
    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar", "dflash", "--paths", "fast",
                 "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["copy_bandwidth"], report["read_bandwidth"]) == (4.2e12, 4.6e12)
    assert report["round_vs_floor_at"] == "measured_read"
    step, round_bytes = report["step_bytes"], report["round_bytes"]
    assert report["floor_ms"] == pytest.approx(dict(spec=1e3 * step / SPEC_BANDWIDTH,
                                                    measured_copy=1e3 * step / 4.2e12,
                                                    measured_read=1e3 * step / 4.6e12))
    assert report["round_floor_ms"]["measured_read"] == pytest.approx(1e3 * round_bytes / 4.6e12)
    ar, dflash = report["results"]
    assert ar["round_vs_floor"] == pytest.approx(ar["round_ms"] * 4.6e12 / (1e3 * step))
    assert dflash["round_vs_floor"] == pytest.approx(dflash["round_ms"] * 4.6e12 / (1e3 * round_bytes))


def test_bench_runs_a_moe_shape_on_the_fast_path_and_counts_only_the_picked_experts(capsys):
    """A Qwen3-MoE shape decodes on the fast path, equal to the eager path; its floor counts k of E experts."""
    from ddtree.bench.shapes import build_shape
    from ddtree.bench.timing import weight_bytes
    from ddtree.models.shapes import SHAPES

    rc = main(["bench", "--shape", "tiny-moe", "--device", "cpu", "--methods", "ar", "ddtree", "--budgets", "8",
               "--paths", "fast", "eager", "--prompts", "1", "--prompt-tokens", "24", "--max-new-tokens", "12"])
    assert rc == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fast")]
    assert rows and all(line.rstrip().endswith("| yes |") for line in rows)  # the fast path's tokens are ar's
    fast, _ = build_shape("tiny-moe", "cpu", torch.float32, fast_capacity=64)
    t = SHAPES["tiny-moe"]["target"]
    experts = 4 * 3 * 8 * 64 * 32  # layers x (gate, up, down) x experts x hidden x moe_intermediate
    params = sum(p.numel() for p in fast.target.model.parameters()) - t["vocab_size"] * t["hidden_size"]
    assert weight_bytes(fast, 0) == 4 * (params - experts + experts * 2 // 8)


def test_bench_fast_path_only_on_a_target_without_one_is_an_error(fast_ckpt, capsys):
    assert main(["bench", "--target", str(fast_ckpt / "swa"), "--draft", str(fast_ckpt / "draft"),
                 "--device", "cpu", "--paths", "fast"]) == 2
    err = capsys.readouterr().err
    assert "no fast path for this target (sliding-window" in err and "--paths eager" in err and "Traceback" not in err


def test_generate_fast_gives_the_reference_tokens(fast_ckpt, capsys, monkeypatch):
    args = ["generate", "--target", str(fast_ckpt / "llama"), "--draft", str(fast_ckpt / "draft"), "--prompt-ids",
            "1,2,3", "--max-new-tokens", "12", "--device", "cpu", "--json"]
    chosen = []
    real = Engine.from_pretrained.__func__
    monkeypatch.setattr(Engine, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: chosen.append(kw["fast"]) or real(cls, *a, **kw)))
    outputs = []
    for extra in ([], ["--fast"], ["--no-fast"]):
        assert main(args + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 12
    assert chosen == [None, True, False]  # unset: the engine decides (on for CUDA)


def test_the_fast_path_defaults_to_on_for_cuda_only(fast_ckpt):
    engine = Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu", fast=None)
    assert engine.fast is None and engine.fast_unsupported == "off"
    assert Engine.from_pretrained(fast_ckpt / "qwen3", fast_ckpt / "draft", device="cpu", fast=True).fast


def test_bench_dtype_sets_the_models_dtype(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--methods", "ar",
                 "--prompts", "1", "--prompt-tokens", "8", "--max-new-tokens", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and all(r["tokens_per_second"] > 0 for r in report["results"])


def test_the_concurrency_bench_compares_every_method_per_level_and_says_where_a_step_goes(tmp_path, capsys):
    out = tmp_path / "concurrency.json"
    rc = main(["bench", "--device", "cpu", "--concurrency", "1", "3", "--budgets", "4",
               "--prompt-tokens", "12", "--max-new-tokens", "6", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    runs = [(r["concurrency"], r["method"]) for r in report["results"]]
    assert runs == [(c, m) for c in (1, 3) for m in ("ar", "dflash", "ddtree", "ddtree batch")]
    for r in report["results"]:
        assert r["same_as_ar"], r  # float32 greedy: every method and the batch budget emit ar's tokens
        assert r["tokens_per_second"] > 0 and r["tau"] >= 1
        assert set(r["phase_ms"]) >= {"tree", "verify", "commit"}
        assert sum(r["phase_ms"].values()) <= r["step_ms"] * 1.001  # phases are parts of the step
        assert r["round_ms"] > 0  # the steps that ran rounds alone, what the predicted time is set against
    drafting = [r for r in report["results"] if r["method"] != "ar"]
    assert all(r["tau"] > 1 for r in drafting)  # trees commit more than a token
    assert all(r["phase_ms"]["draft"] > 0 for r in drafting if r["concurrency"] == 3)  # the batched rounds draft
    table = capsys.readouterr().out
    assert "| ms by phase |" in table and "| round ms | predicted ms |" in table and "verify " in table
