"""Which kernels let the next one launch before they wait (jit.early_pdl): a tree verify's norms, heads and
attention, where the next projection is the Hopper GEMM's (33-136 rows). Elsewhere the next kernel is the
few-row GEMM, the GEMV or cuBLAS, and an early launch there made a B = 16 round 0.1 ms slower (RESULTS v31)."""

import pytest
import torch
from ddtree.fast import jit, wgmma

CPU = torch.device("cpu")  # the rule reads only pdl(device), patched here as a Hopper GPU's answer


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(jit, "pdl", lambda device: True)
    monkeypatch.setattr(wgmma, "ENABLED", True)


@pytest.mark.parametrize("step", ["norm", "heads", "attention"])
@pytest.mark.parametrize(("rows", "early"), [(65, True), (33, True), (129, True), (136, True), (17, False),
                                             (16, False), (1, False), (137, False), (512, False)])
def test_only_rows_the_hopper_gemm_takes_next_launch_early(hopper, step, rows, early):
    assert jit.early_pdl(CPU, rows, step) == (2 if early else 1)


def test_early_launches_turn_off_by_step_by_switch_and_without_pdl_or_the_gemm(hopper, monkeypatch):
    assert jit.early_pdl(CPU, 65, "silu") == 1  # a step not in the set
    monkeypatch.setattr(jit, "EARLY_LAUNCH", jit.EARLY_LAUNCH - {"norm"})
    assert jit.early_pdl(CPU, 65, "norm") == 1
    assert jit.early_pdl(CPU, 65, "attention") == 2
    monkeypatch.setattr(wgmma, "ENABLED", False)  # DDTREE_WGMMA=0: cuBLASLt's GEMMs do not wait, nor preload
    assert jit.early_pdl(CPU, 65, "attention") == 1
    monkeypatch.setattr(wgmma, "ENABLED", True)
    monkeypatch.setattr(jit, "pdl", lambda device: False)
    assert jit.early_pdl(CPU, 65, "attention") == 0
