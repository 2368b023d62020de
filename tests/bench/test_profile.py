"""`ddtree bench --profile`: kernels put in their kinds of layer by name, profiles summed into a step's table,
and the flag end to end on the CPU."""

import json
import re
from pathlib import Path

import pytest
from ddtree.bench import profile
from ddtree.bench.profile import KINDS, Event, Sizes, Step, classify, kind_of, ms_by_kind, summarize
from ddtree.cli import main

KERNELS = Path(profile.__file__).parents[1] / "kernels"

# names as torch.profiler reports them on an H100 / H200 (CUDA kernels) and on a CPU (aten ops)
NAMED = [
    ("_paged_kernel", "attention"),
    ("_split_kernel", "attention"),
    ("_norm_kernel", "norms"),
    ("_silu_kernel", "activations"),
    ("_heads_kernel", "rotary"),
    ("_gemv_kernel", "projections"),
    ("_skinny_kernel", "projections"),
    ("wgmma_linear", "projections"),
    ("_varlen_delta_kernel", "recurrent"),
    ("_tree_delta_kernel", "recurrent"),  # a Gated DeltaNet kernel over a tree, not the tree build
    ("_up_kernel", "moe"),
    ("_tree_kernel", "sampling"),
    ("_merge_top_kernel", "sampling"),  # not attention's _merge_kernel
    ("_walk_kernel", "sampling"),
    ("_compact_kernel", "copies"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "projections"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
     "cublas", "projections"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(cutlass_80_tensorop_"
     "bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)", "projections"),  # a GEMM, though it says relu
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>("
     "cublasLt::cublasSplitKParams<float>)", "projections"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>",
     "projections"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t>, false>(Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
     "attention"),  # cutlass inside, but attention
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
     "at::TensorIteratorBase&)::{lambda()#1}, std::array<char*, 2ul> >(int, float, std::array<char*, 2ul>)",
     "activations"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#3}> >(int, at::native::gpu_kernel_impl_nocast)", "copies"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float>)",
     "sampling"),  # a gather in the name, but a top-k
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("Memset (Device)", "copies"),
    ("fused_recurrent_gated_delta_rule_fwd_kernel", "recurrent"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms"),
    ("triton_poi_fused_add_cat_mul_neg_slice_1", "rotary"),  # rotate-half
    ("triton_poi_fused_mul_silu_2", "activations"),
    ("triton_poi_fused__to_copy_cat_3", "copies"),
    ("triton_poi_fused_add_4", None),  # a residual add: nothing in its name says which layer
    ("aten::mm", "projections"),
    ("aten::linear", "projections"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::topk", "sampling"),  # not aten::to
    ("aten::to", "copies"),
    ("aten::index_put_", "copies"),
    ("aten::mul", None),
]


@pytest.mark.parametrize(("name", "kind"), NAMED)
def test_kernels_and_ops_go_to_their_kind_of_layer_by_name(name, kind):
    assert classify(name) == kind


def test_every_kernel_of_ddtree_kernels_has_a_kind_and_every_named_one_exists():
    """A new Triton kernel without a kind would land in `other` unseen; a renamed one would leave a stale name."""
    source = "\n".join(p.read_text() for p in sorted(KERNELS.glob("*.py")))
    defined = set(re.findall(r"@triton\.jit\s+def (\w+)\(", source))
    defined = {name for name in defined if name.endswith("_kernel")}
    cuda = r'extern "C" __global__ void(?: __launch_bounds__\([^\n]*\))?\s+(\w+)\('
    defined |= set(re.findall(cuda, (KERNELS / "wgmma.cu").read_text()))
    assert len(defined) > 20 and "wgmma_linear" in defined
    assert defined == set(profile.OURS)
    assert all(classify(name) in KINDS for name in defined)


def test_a_cpu_op_takes_the_kind_of_its_outermost_classified_op():
    assert kind_of(Event("aten::mm", 1.0, ("aten::scaled_dot_product_attention", "aten::matmul"))) == "attention"
    assert kind_of(Event("aten::copy_", 1.0, ("aten::linear", "aten::matmul", "aten::contiguous"))) == "projections"
    assert kind_of(Event("aten::mul", 1.0, ("aten::rms_norm",))) == "norms"
    assert kind_of(Event("aten::mul", 1.0, ("aten::mean",))) == "other"  # an unnamed op, in an unnamed op
    assert kind_of(Event("aten::mul", 1.0)) == "other"


SIZES = Sizes(weights=4_000_000, draft=1_000_000, kv_token=1000, draft_kv_token=100, state=5000)


def test_a_profile_sums_kernels_by_kind_a_step_and_sets_the_floored_kinds_against_their_bytes():
    events = [Event("nvjet_tst_64x8", 1500.0), Event("_gemv_kernel", 500.0), Event("_paged_kernel", 400.0),
              Event("_norm_kernel", 200.0), Event("triton_poi_fused_add_4", 100.0), Event("Memcpy DtoD", 100.0),
              Event("_row_kernel", 200.0)]
    steps = [Step(0.0015, 4, 1000), Step(0.0025, 4, 1400)]  # two steps: per-step means
    ms = ms_by_kind(events, len(steps))
    assert list(ms) == list(KINDS)
    assert ms["projections"] == pytest.approx(1.0) and ms["attention"] == pytest.approx(0.2)
    assert ms["other"] == pytest.approx(0.05) and ms["moe"] == 0.0

    p = summarize(events, steps, SIZES, speculative=False, ceilings=(None, 2e12), source="CUDA kernels")
    assert p["steps"] == 2 and p["step_ms"] == pytest.approx(2.0) and p["sequences"] == 4
    assert p["total_ms"] == pytest.approx(1.5) and sum(p["share"].values()) == pytest.approx(1.0)
    assert p["share"]["projections"] == pytest.approx(1.0 / 1.5)
    assert p["floor_at"] == "measured_read" and p["floor_bandwidth"] == pytest.approx(2e12)
    assert p["bytes"] == {"projections": 4_000_000, "attention": 1000 * 1200, "recurrent": 5000 * 4}
    assert p["gb_per_s"]["projections"] == pytest.approx(4.0)  # 4 MB in 1 ms
    assert p["vs_floor"]["projections"] == pytest.approx(1.0 / (1e3 * 4e6 / 2e12))  # 1 ms against 2 µs
    assert p["vs_floor"]["attention"] == pytest.approx(0.2 / (1e3 * 1.2e6 / 2e12))

    spec = summarize(events, steps, SIZES, speculative=True, ceilings=(None, None), source="CUDA kernels")
    assert spec["bytes"]["projections"] == 5_000_000  # the draft's weights too
    assert spec["bytes"]["attention"] == 1100 * 1200  # and its context K/V
    assert spec["floor_at"] == "spec"

    table = profile.table("profile at concurrency 4", [("ar", p), ("ddtree B=4", spec)])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert set(KINDS) <= set(rows) and {"sum", "step (wall)", "projections: weights", "attention: KV read"} <= set(rows)
    assert rows["projections"] == "| projections | 1.00 (67%) | 1.00 (67%) |"
    assert "4 MB, 4 GB/s, 500x floor" in rows["projections: weights"]


def test_kernels_on_a_timeline_are_charged_what_they_add_to_its_span_and_the_gaps_are_idle():
    """Under programmatic dependent launch a kernel starts before the one it waits for ends: its duration counts
    that wait, its increment does not."""
    events = [Event("_gemv_kernel", 10.0, start=100.0), Event("_paged_kernel", 10.0, start=105.0),  # 5 µs overlap
              Event("_norm_kernel", 5.0, start=120.0), Event("_silu_kernel", 2.0, start=121.0)]  # idle 5, then inside
    ms = ms_by_kind(events, steps=1)
    assert 1e3 * ms["projections"] == pytest.approx(10) and 1e3 * ms["attention"] == pytest.approx(5)
    assert 1e3 * ms["idle"] == pytest.approx(5) and 1e3 * ms["norms"] == pytest.approx(5)
    assert ms["activations"] == 0.0  # it ended before the norm did: the span does not wait for it
    assert 1e3 * sum(ms.values()) == pytest.approx(25)  # first start to last end


def test_kinds_that_did_not_run_or_read_nothing_get_no_rate():
    p = summarize([Event("_norm_kernel", 10.0)], [Step(0.001, 1, 10)], SIZES, False, (None, None), "CPU")
    assert p["bytes"] == {} and p["share"]["norms"] == 1.0
    empty = summarize([], [], SIZES, False, (None, None), "CPU")
    assert empty["steps"] == 0 and empty["total_ms"] == 0 and set(empty["share"].values()) == {0.0}
    assert "projections: weights" not in profile.table("t", [("ar", p)])


def test_the_concurrency_bench_profiles_every_method_at_every_level(tmp_path, capsys):
    out = tmp_path / "concurrency.json"
    assert main(["bench", "--device", "cpu", "--concurrency", "1", "2", "--budgets", "4", "--prompt-tokens", "12",
                 "--max-new-tokens", "8", "--profile", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["concurrency"], r["method"]) for r in report["results"]] == [
        (c, m) for c in (1, 2) for m in ("ar", "dflash", "ddtree", "ddtree batch")]
    for r in report["results"]:
        p = r["profile"]
        assert p["source"] == "CPU ops' self time" and p["steps"] == 2 and p["sequences"] > 0
        assert list(p["ms"]) == list(KINDS) and sum(p["ms"].values()) == pytest.approx(p["total_ms"])
        assert sum(p["share"].values()) == pytest.approx(1.0)
        assert 0 < p["total_ms"] <= p["step_ms"]  # the ops' own time is part of the step's
        assert p["share"]["projections"] > 0.3  # the demo pair's steps are mostly matrix products
        assert p["ms"]["attention"] > 0 and p["bytes"]["attention"] > 0 and p["gb_per_s"]["projections"] > 0
        if r["method"] != "ar":
            assert p["ms"]["sampling"] > 0  # drafting rounds pick the draft's tokens
    ar, dflash = report["results"][:2]
    assert dflash["profile"]["bytes"]["projections"] > ar["profile"]["bytes"]["projections"]  # + the draft
    printed = capsys.readouterr().out
    assert "profile at concurrency 1: CPU ops' self time" in printed and "profile at concurrency 2" in printed
    assert printed.count("| projections: weights |") == 2 and "| ddtree batch B=4 |" in printed


def test_the_single_path_bench_profiles_its_fast_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--paths", "fast", "--methods", "ar", "ddtree",
                 "--budgets", "4", "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "8",
                 "--profile", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["profile"]["steps"] for r in results] == [2, 2]
    assert all(sum(r["profile"]["share"].values()) == pytest.approx(1.0) for r in results)
    assert "| kind | ar | ddtree B=4 |" in capsys.readouterr().out


def test_bench_refuses_a_profile_of_no_steps(capsys):
    assert main(["bench", "--device", "cpu", "--concurrency", "1", "--profile", "0"]) == 2
    assert "--profile needs at least 1 step" in capsys.readouterr().err
