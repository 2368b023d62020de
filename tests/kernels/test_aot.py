"""Every Triton kernel of the fast path (bf16 and fp8) compiles ahead of time, on this CPU-only machine, for Ada
(8.9), Hopper (9.0) and Blackwell workstation GPUs (12.0) within their shared memory (ddtree/kernels/aot.py), and
the kernel each product takes per capability is a table."""

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def built():
    """aot.report for 8.9, 9.0 and 12.0, in a process of its own: the suite runs Triton's interpreter, and ahead-of-
    time builds need the compiler."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "ddtree.kernels.aot", "89", "90", "120"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.slow
@pytest.mark.parametrize("capability", [89, 90, 120])
def test_every_fast_path_kernel_compiles_for_the_capability_within_its_shared_memory(built, capability):
    """At the tuned tiles, with no shrinking (the bf16 and fp8 GEMMs, GEMVs, norms, attention, paged attention,
    bf16 and fp8 experts, the Gated DeltaNet step, tree and varlen kernels); the limits: 99 KB a block on 8.9 and
    12.0, 227 KB on 9.0."""
    from ddtree.kernels import aot

    rows = built[capability]
    names = {row["name"] for row in rows}
    assert {"paged attention", "paged attention with sinks", "skinny fp8 128x128 blocks 5120x17408",
            "norm fp8 5120", "Gated DeltaNet AR step", "Gated DeltaNet varlen prep",
            "Gated DeltaNet varlen delta 64", "Gated DeltaNet commit", "experts route fp8",
            "experts gate/up fp8 channel", "experts down fp8 128x128 blocks"} <= names
    assert all("error" not in row for row in rows), [row for row in rows if "error" in row]
    assert all(row["shared"] <= aot.SHARED_LIMIT[capability] and not row["shrunk"] for row in rows)


@pytest.mark.parametrize(("capability", "wgmma", "fp8"), [((8, 6), False, False), ((8, 9), False, True),
                                                           ((9, 0), True, True), ((12, 0), False, True)])
def test_the_kernel_choice_per_capability_is_what_the_dispatch_does(monkeypatch, capability, wgmma, fp8):
    """aot.choices' table against the code that dispatches: wgmma.supported (Hopper only) and the fp8 checks."""
    from ddtree.kernels import aot, gemm
    from ddtree.kernels import wgmma as wgmma_module
    from ddtree.models.quantize import check_device

    code = capability[0] * 10 + capability[1]
    table = aot.choices(code)
    assert (table["33-136 rows, bf16"] == "wgmma GEMM (NVRTC)") == wgmma
    assert (table["fp8 weights, any rows"] != "refused") == fp8
    assert (table["programmatic dependent launch"] == "yes") == (code >= 90)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {
        "multi_processor_count": 132})())
    x = type("Rows", (), {"is_cuda": True, "device": torch.device("cuda"), "dim": lambda self: 2,
                          "dtype": torch.bfloat16, "shape": (64, 4096)})()  # 64 rows on a (pretend) GPU
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    monkeypatch.setattr(wgmma_module.nvrtc, "tma_compatible", lambda t: True)
    assert wgmma_module.supported(x, w) == wgmma
    if fp8:
        check_device(torch.device("cuda"), "an fp8 target")
    else:
        with pytest.raises(Exception, match="fp8 tensor cores"):
            check_device(torch.device("cuda"), "an fp8 target")
    assert gemm.FP8_ROW_TILE > 0  # the fp8 GEMM takes any row count (in row tiles)


@pytest.mark.slow
def test_the_hopper_wgmma_gemm_compiles_with_nvrtc_for_sm_90a():
    """The one CUDA C++ kernel of the fast path (wgmma.cu, NVRTC): Hopper only, as the table says."""
    from ddtree.kernels import wgmma

    try:
        cubin = wgmma.cubin(wgmma.launch_config(4096, 4096, 64), torch.bfloat16)
    except OSError as exc:
        pytest.skip(f"no NVRTC library here ({exc})")
    assert cubin[:4] == b"\x7fELF"
